"""pi-plan: where every FFN neuron and dense block of a model lives, GPU(s) or CPU, for the fastest predicted decoding.

One concern per module:
    hardware     GPU table (gpus.toml), CPU detection, --hw files
    machine      this machine: the cache (measured CPU bandwidth, calibrations) and resolve_hardware, above
                 hardware, calibration and costmodel (it imports them, they never import it)
    memory       byte accounting from tensor shapes and types (real files and skeletons alike)
    activations  per-neuron activation frequencies (pi-profile's act_counts, PowerInfer's activation/ dirs)
    problem      one model on one machine: bytes, frequency-sorted prefixes, costs, budgets
    costmodel    predicted time per token of a plan, and the paper's C_l from the sync cost
    plan         the placement itself
    ilp          the PuLP model (CBC or HiGHS), its start, checks and polish
    warmstart    a Lagrangian heuristic plan the solver starts from
    baselines    layers (llama.cpp -ngl), powerinfer, cpu, gpu
    planfile     plans in GGUF files, fingerprints, PowerInfer's .generated.gpuidx
    skeleton     weightless GGUFs of known shapes with synthetic statistics
    calibration  fitting the CPU constants to measured pi-run times
    report, cli  what pi-plan prints, and the typer app
"""
