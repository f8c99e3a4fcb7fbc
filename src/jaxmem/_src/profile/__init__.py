"""Memory profiles: reports, XLA buffer assignment, the profile command."""
