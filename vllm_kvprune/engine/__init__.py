"""Scheduler side ("the scheduler reserves"): a capped KV-cache spec and manager, and a
scheduler that applies per-request budgets and keeps prefill chunks where the policy needs
them. Everything here runs in the engine-core process."""
