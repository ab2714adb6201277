"""Activation profiling (pi-profile): the built-in corpus, activity rules, counting activations, training
predictors, what is stored in the model, and PowerInfer's activation and predictor directories."""
