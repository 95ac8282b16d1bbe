"""Backward of the ops: autograd functions (:mod:`.functions`), attention by
recomputation (:mod:`.attention`) and the weight-version guard (:mod:`.weights`).
The public entry points are in :mod:`unified_models.ops.autograd`."""
