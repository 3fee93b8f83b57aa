"""Reinforcement learning from rewards (docs/rl.md): what turns sampled completions and their
rewards into what the policy-gradient objective (train.objectives.policy_gradient) trains on."""
