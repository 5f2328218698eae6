"""The one rule for tiny sampling temperatures, shared by the API, the engines, the config and the trainer.

Temperatures in (0, ``GREEDY_BELOW``) are greedy. Below it the sampling distribution is a point mass in all but
float rounding, and dividing logits by it breaks the numbers downstream: 1e-300 is 0.0 in float32 (an engine
would see "greedy" in one place and "sample at 1" in another), and 1/T is infinite in the trainer. With one rule
a turn stores the temperature its answer was really sampled at, and training scores it at that temperature.
"""

GREEDY_BELOW = 0.01
"""The smallest positive temperature that samples; anything below it is greedy (0.0)."""


def effective_temperature(temperature: float) -> float:
    """The temperature a request is actually sampled and scored at: 0.0 (greedy) below ``GREEDY_BELOW``."""
    return 0.0 if temperature < GREEDY_BELOW else float(temperature)
