"""The update path as one package: everything between an RL weight update reaching SGLang and its bytes landing in a
layer, and the way back when a disk update fails.

Data flows one way: SGLang hook (builtins/loader_hooks.py, builtins/weight_updates.py) → here (is the write right?
then where do its bytes go?) → the format (formats/: un-prepare the written experts) → layouts (layouts/: the byte
moves) → storage. Nothing here imports a hook; nothing below imports this package.

Validation, before a byte changes:

* `validation.py` — one loader write (`check_write`: name, shard, expert id, device, dtype, shape, values; the
  loader hooks' per-write check), a fused all-expert write (`validate_fused`), the local expert id
  (`check_local_expert`);
* `bucket_validation.py` — a whole request: a tensor bucket (`check_bucket`), a direct write, a checkpoint
  directory (`check_checkpoint`, with `checkpoint_headers.py`: the directory's safetensors headers, file sizes, and
  the values read from the files);
* `value_checks.py` — the values of scales, many tensors at once (one read-back per device);
* `layer_params.py` (a write's layer and parameter as the checks see them), `refusal.py` (how a write is refused;
  a tensor's value job), `write_plans.py` (the rules of a write, declared once, and
  what a write into one parameter must look like, compiled from them once per parameter),
  `checked_writes.py` (what a running request already validated, and the loader hooks' thread-local handshake).

Writing and undoing:

* `batched_writes.py` — a validated bucket's expert tensors written per (layer, parameter), where
  `slot_plans.py` traced SGLang's own loader once to say where the bytes go;
* `rollback.py` — a failed disk update changes nothing (replay of unchanged checkpoints, or a host snapshot);
* `undo.py` — a failed request of a custom weight loader (`--custom-weight-loader`: verl's sparse delta) changes
  nothing (host copies of what it writes, taken before the first write).

Bytes that never pass through a loader (P2P / RDMA writers inside a weight-update session):

* `loader_free.py` — the end of such a session: the values a load would refuse, found before anything is laid out;
  refused experts fenced as zero experts;
* `session_writes.py` — the writer's hint (which experts a session writes);
* `writer_contract.py` — what such a writer writes into each parameter, traced from SGLang's own loader, and what
  the end of the session lays out and recomputes.
"""
