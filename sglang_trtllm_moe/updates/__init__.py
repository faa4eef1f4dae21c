"""The update path as one package: everything between an RL weight update reaching SGLang and its bytes landing in a
layer, and the way back when a disk update fails.

Data flows one way: SGLang hook (builtins/loader_hooks.py, builtins/weight_updates.py) → here (is the write right?
then where do its bytes go?) → the format (formats/: un-prepare the written experts) → layouts (layouts/: the byte
moves) → storage. Nothing here imports a hook; nothing below imports this package.

One request, one object:

* `request.py` — an update request as SGLang serves it (`UpdateRequest`: its runners and what was checked for each,
  its ranks, each model's name index, whether its expert tensors are written batched): check → one verdict of all
  ranks → writes; a disk update's check_checkpoint → stream;
* `name_index.py` — a model's checkpoint names → layer, parameter, shard, expert and this rank's slots, built once;
* `verdicts.py` — one verdict for all ranks of a request (SGLang's TP CPU group; a rank that raises or is late).

Validation, before a byte changes:

* `validation.py` — one loader write (`check_write`: name, shard, expert id, device, dtype, shape, values; the
  loader hooks' per-write check), a fused all-expert write (`validate_fused`), the local expert id
  (`check_local_expert`);
* `bucket_validation.py` — a request's list (`check_items`: each rank its own experts, per run of experts of one
  buffer; `check_bucket`: one model, this rank alone), a direct write; `checkpoint_checks.py` — a checkpoint
  directory (`check_checkpoint`, with `checkpoint_headers.py`: the directory's safetensors headers, file sizes, and
  the values read from the files, kept for the update to write);
* `value_checks.py` — the values of scales, many tensors at once (one read-back per device);
* `layer_params.py` (a write's layer and parameter as the checks see them), `refusal.py` (how a write is refused;
  a tensor's value job), `write_plans.py` (the rules of a write, declared once; one plan per parameter that accepts
  a write, or hands it to the full checks that explain a refusal), `checked_writes.py` (what a running request already
  validated, and the loader hooks' thread-local handshake).

Writing and undoing:

* `batched_writes.py` — a validated list's expert tensors written per (layer, parameter), another rank's dropped,
  where `slot_plans.py` traced SGLang's own loader once to say where the bytes go and `slot_writes.py` writes a run
  of experts of one buffer with one copy;
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
