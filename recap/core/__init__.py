"""Cache core: integer bookkeeping only (hashing, pools, managers, policy, scheduler). Imports no torch."""
