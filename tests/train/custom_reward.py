"""A user's reward for the end-to-end test (`config.reward.kind=callable`): 1.0 for a trajectory of an
odd number of steps, else 0.0 — nothing like the paper's table, so its use is visible in the metrics."""

CALLS: list[float] = []


def odd_steps(steps, golds):
    del golds
    value = float(len(steps) % 2)
    CALLS.append(value)
    return value


def not_a_float(steps, golds):
    del steps, golds
    return "high"
