"""What the families' backward modules (``ops/<family>/backward.py``) share: the
weight-version guard (:mod:`.weights`) and small helpers (:mod:`.helpers`). The
public differentiable entry points are gathered in :mod:`unified_models.ops.autograd`."""
