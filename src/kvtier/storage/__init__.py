"""Storage tiers behind one small interface, and the manager that chains them."""
