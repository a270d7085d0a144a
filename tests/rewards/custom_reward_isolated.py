"""A reward function that only the reward workers may import: the custom-reward tests check that the
test process never does (no test imports this module)."""


def score(response, ground_truth, extra):
    return 1.0 if response == ground_truth else 0.0
