"""A reward module whose import fails (``reward.function: tests.rewards.custom_reward_broken:score``)."""

raise RuntimeError("this reward module is broken on purpose")
