"""RL: advantages, policy and targeted-guidance losses, batch building, train step."""
