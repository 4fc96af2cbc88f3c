"""Differentially private mechanisms on the data before training: DP-PCA
(:mod:`~keras_dpsgd.preprocessing.pca`), DP moments for normalization
(:mod:`~keras_dpsgd.preprocessing.normalization`) and DP vocabularies
(:mod:`~keras_dpsgd.preprocessing.vocabulary`), each recorded as privacy events."""
