"""Process groups, per-call step state and the communication layer shared by every strategy."""
