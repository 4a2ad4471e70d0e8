"""Trainer -> rollout engine weight sync (``rollout.weight_sync``), collective over every trainer rank.

The path of a byte, one module per hop::

    trainer shard --senders.py--> HF tensor --buckets.py--> Bucket --transport.py--> the sender's channel
        --receivers/{embedded,sglang}.py--> engine tensor      (checked by verify.py against layout.py)

* ``plan.py``: what a sync moves and holds (``megatron-rl check``).
* ``senders.py``: gather each parameter's TP / EP / ETP shards into HF tensors, pack them into buckets.
* ``buckets.py``: ``Bucket`` (tensors of one dtype back to back in one flat buffer), ``bucketize``, checksums.
* ``delta.py`` + ``delta_sender.py``: delta syncs (``rollout.weight_sync_delta``) -- per tensor only the elements
  whose bits changed, packed into ``DeltaBucket``s by each sender against its copy of what the engine
  holds; ``server_loader.py`` applies them inside each SGLang server process (its custom weight loader).
* ``transport.py``: the channels -- bucket send / receive between trainer ranks, each sender's update group
  with the SGLang servers.
* ``stream.py``: the streamed sync -- every sender through its channel, verification in passing, the commit.
* ``board.py``: the senders' outcomes and rank 0's decision, each wait bounded, a missing sender named.
* ``receivers/``: the engine ends (``embedded.py``: copy into the in-process model; ``sglang.py``: HTTP update
  sessions of SGLang servers).
* ``layout.py`` + ``verify.py``: how an engine holds each tensor, and the checksum comparison built on it.
* ``exports.py``: disk exports (bytes, pruning).
* ``modes.py``: the mode (``rollout.weight_sync``) as one object, chosen once when the job is built: it opens the
  engine's one receiver interface (``begin_weight_sync(version, timeout_s, groups)``), no mode string reaches an
  engine.
* ``publisher.py``: the publisher object the mode picks (stream, delta, disk, deferred).
* ``report.py``: ``SyncReport``, the ``weight_sync/*`` metrics.

Modes (``modes.py`` builds the mode object once, from ``rollout.weight_sync`` or the engine
class's default: tensor for the embedded engine, distributed for SGLang, disk for SGLang in ``rollout.mode: async``):

* ``disk`` — rank 0 writes an HF export (``actor.export_hf``) and the engine loads the directory
  (SGLang ``/update_weights_from_disk``). Memory: the full model on rank 0; the fallback.
* ``tensor`` / ``distributed`` — several senders (``stream.py``): every pipeline stage's and every
  expert-parallel rank's shard owner gathers its own tensors one parameter at a time (TP / ETP gathers,
  ``senders.own_buckets``), packs them into ``buckets.Bucket`` buffers of ``rollout.weight_sync_bucket_mb`` and
  sends them over its own channel (``WeightReceiver.channel()``), in parallel with the others. tensor: into the
  embedded engine in rank 0's process (each other sender over its own gloo pair group), or to SGLang through
  shared memory (``/update_weights_from_tensor``, same host); distributed: each sender broadcasts in its own
  gloo (CPU) / NCCL (GPU) update group with every server TP rank (``/update_weights_from_distributed``).
  Peak extra host memory on a sender: one bucket + the parameter being gathered, never the model.
* Failures: every sender posts its outcome (``board.py``); rank 0 commits only when every sender is done and
  every tensor came once; a bucket the engine rejects, a dead server, a sender that died or hangs (named, within
  ``rollout.weight_sync_timeout_s``) aborts the version on every server (``WeightReceiver.abort``), and the
  error is raised on every rank.
* Verification (``verify.WeightVerifier``, every ``rollout.weight_sync_verify_interval``-th version,
  in every mode, sync and async): ``rollout.weight_sync_verify_tensors`` of the ENGINE's tensors (-1: all),
  spread over the model and rotated by version, are rebuilt from the trainer's HF tensors as the engine
  holds them (fused qkv / gate_up / experts, zero-padded vocabulary rows, one shard per server TP rank:
  ``layout.py``) and their checksums compared with the engine's (``weights_checker`` on SGLang);
  a mismatch fails the sync naming each engine tensor, its HF sources and the TP rank. Streamed: taken from
  the buckets as they pass; disk: from the export after the engine loaded it; async: by the producer after
  it applied the version (a failure surfaces at the next step's rollouts).
* Disk exports (``exports.py``): only the versions an engine may still load or holds are kept (sync: the last
  one; async: ``RolloutProducer.versions_in_use``); older ``step-N`` exports are deleted.
* Async rollouts (``rollout.mode: async``): the producer thread applies weights later, on rank 0 alone.
  disk: the export directory is the payload; tensor (embedded engine): the buckets are collected on rank 0
  (owned copies: the full model there) and applied by the producer between generation segments, as the one
  sender, with the sync mode's version tags, atomicity and verification (embedded engine: in process; SGLang
  tensor: shared memory; SGLang distributed: the producer's own update group with the servers).

Metrics: ``weight_sync/bytes``, ``weight_sync/buckets``, ``weight_sync/senders``, ``weight_sync/verified`` (1 when
verified), ``weight_sync/verified_param_frac`` (parameters inside the compared engine tensors / all parameters; in async
mode the producer verifies later, so the step's metric is 0 and a failure surfaces at the next rollouts);
the loop times the call as ``timing/weight_sync_s``.
"""