"""`k3 plan`: a capacity planner for K3-family models on real clusters.

    from k3.platform.ops.plan.planner import make_plan
    from k3.platform.ops.plan.render import render

    print(render(make_plan(get_preset("k3"), "k3", context=1_048_576, gpus=64, gpu="h200")))

The formulas live by subject: hardware.py (the GPU table and its assumptions), activations.py
(bytes per token the training forward keeps, read off the model code), training.py (memory and
traffic per GPU for a DP x CP x EP layout), serving.py (cache per sequence from
`k3.model.cache`, sequences per GPU, prefill time). Parameter counts come from
`k3.model.params` (meta device). planner.py puts them together (`make_plan`); render.py prints
a plan as a table, each line with its reason, or as JSON. Importing this package imports nothing,
and hardware.py is torch-free: the CLI checks a GPU name before it loads torch.
"""
