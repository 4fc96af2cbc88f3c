"""Valid, cheap command lines of the accounting subcommands, shared by the CLI tests."""

DATA = ["--num-examples", "1000", "--epochs", "1"]
EPSILON = ["epsilon", *DATA, "--lot-size", "10", "--noise-multiplier", "1.1"]
NOISE = ["noise", *DATA, "--lot-size", "10", "--target-epsilon", "2"]
LARGE_LOTS = ["large-lots", *DATA, "--target-epsilon", "3", "--lot-sizes", "10"]
ADAPTIVE_NOISE = [
    "adaptive-clipping-noise",
    *("--num-layers", "2", "--norm-noise-multiplier", "5", "--delta", "1e-5"),
    *("--sampling-rate", "0.01", "--steps", "10", "--target-epsilon", "3"),
]
