"""The FFN block, dense or activation-sparse: the blocks (dense.py, sparse.py), operators over neuron sets (ops.py)
and the predictors that choose each token's neurons (predictor.py)."""
