"""Trainer -> rollout engine weight sync (``rollout.weight_sync``), collective over every trainer rank.

The path of a byte, one module per hop::

    trainer shard --senders.py--> HF tensor --buckets.py--> Bucket --transport.py--> the sender's channel
        --receivers/{embedded,sglang}.py--> engine tensor      (checked by verify.py against layout.py)

``settings.py`` holds every choice of a job's sync (the mode of ``modes.py`` resolved once, ``auto`` included);
``publisher.py`` is what the trainer calls; ``stream.py`` the streamed sync with ``board.py`` for the senders'
outcomes; ``delta.py`` / ``delta_sender.py`` / ``server_loader.py`` the delta sync; ``exports.py`` the disk mode;
``report.py`` the ``weight_sync/*`` metrics. The one rule: this package sits BELOW the engines -- an engine
implements ``endpoint.WeightEndpoint`` (with ``versions.py``, its ``receivers/`` end and ``layout.py``: all it
imports from here) and nothing here imports an engine. docs/weight_sync.md has the modes, verification, bounds,
async rollouts and the measured cost.
"""
