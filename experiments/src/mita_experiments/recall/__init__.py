"""Multi-query associative recall (spec section 9): generator, task and sweep on the shared trainer."""
