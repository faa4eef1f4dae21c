"""CPU harness: stand SGLang up on a machine without a GPU, build real layers and models, make checkpoints.

Optional and never imported by `register()` (a test asserts it): nothing here runs in a server process. It
serves the tests, `sglang-trtllm-moe demo`, `bench` and `tiny-checkpoint`: what differs per SGLang release in
standing up a process (platform faking, publishing ServerArgs, model-parallel groups), real FusedMoE layers with
random calibrated checkpoints, and references to compare against.
"""
