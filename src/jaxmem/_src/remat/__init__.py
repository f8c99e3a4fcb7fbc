"""Rematerialization: policies, checkpoint names, the memory-budget planner."""
