"""Small environments for evaluation demos (pure Python, standard library only)."""
