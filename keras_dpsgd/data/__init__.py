"""Data sets and small models for the command line (``keras-dpsgd train``) and the examples.
Internal modules."""
