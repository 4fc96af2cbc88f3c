"""The DP step, shared by both Kerases and every backend: the settings, the math of clipping and
noise, Poisson lots (:mod:`keras_dpsgd.step.lots`), the sanitizer mixin, distribution and the
one-call helper. Internal modules; the public names are re-exported by :mod:`keras_dpsgd`."""
