"""Where a scalar reward model runs: ``LocalRM`` (the HF ``*ForSequenceClassification`` forward on CPU in this
process) and ``SGLangRM`` (SGLang servers started with ``--is-embedding``: ``POST /classify`` with token ids).

Both answer ``scores(batch) -> one float per sample`` for a batch of token-id lists, and raise ``RMError`` for a
batch they could not score (the caller counts its samples as failed / timed out: the reward-failure policy). Rule:
the score is the head's output at the last token of each sample (SGLang's ``LAST`` pooling; HF's own forward pools
there too when the sample has no padding).
"""
from __future__ import annotations

import itertools
import json
import math
import socket
import threading
import urllib.error
import urllib.request
from typing import Any, List, Sequence

import torch


class RMError(Exception):
    """A batch the reward model could not score (named: the server / the path, the cause)."""

    def __init__(self, message: str, timed_out: bool = False):
        super().__init__(message)
        #: True when every try ran past ``reward.model.timeout_s``.
        self.timed_out = timed_out


class LocalRM:
    """The RM's HF checkpoint on CPU, fp32 (tiny models; a real RM belongs on an SGLang server)."""

    def __init__(self, path: str):
        """Load ``path`` (``reward.model.path``); ``ValueError`` naming it when it is not a one-label
        ``*ForSequenceClassification``."""
        from transformers import AutoConfig, AutoModelForSequenceClassification  # heavy: a local-RM job only

        try:
            config = AutoConfig.from_pretrained(path)
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"reward.model.path={path!r}: no HF config.json ({type(e).__name__}: {e})") from e
        archs = list(getattr(config, "architectures", None) or [])
        if not any(a.endswith(("ForSequenceClassification", "ForRewardModel")) for a in archs):
            raise ValueError(f"reward.model.path={path!r}: architectures {archs} is not a *ForSequenceClassification "
                             "reward model")
        if getattr(config, "num_labels", 1) != 1:
            raise ValueError(f"reward.model.path={path!r}: num_labels={config.num_labels}; a scalar reward model has "
                             "one label")
        self.path = path
        self.model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
        if not hasattr(self.model, "score"):
            raise ValueError(f"reward.model.path={path!r}: {type(self.model).__name__} has no 'score' head")
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.max_len = int(getattr(text, "max_position_embeddings", 0) or 0)

    def scores(self, batch: Sequence[Sequence[int]]) -> List[float]:
        """The head's output at each sample's last token (right padding, attention mask)."""
        longest = max(len(s) for s in batch)
        if self.max_len and longest > self.max_len:
            raise RMError(f"reward.model.path={self.path!r}: a sample of {longest} tokens is longer than the RM's "
                          f"max_position_embeddings={self.max_len}")
        ids = torch.zeros(len(batch), longest, dtype=torch.long)
        mask = torch.zeros(len(batch), longest, dtype=torch.long)
        for b, s in enumerate(batch):
            ids[b, :len(s)] = torch.tensor(list(s), dtype=torch.long)
            mask[b, :len(s)] = 1
        base = getattr(self.model, self.model.base_model_prefix)
        with torch.no_grad():
            hidden = base(input_ids=ids, attention_mask=mask).last_hidden_state
            last = torch.tensor([len(s) - 1 for s in batch])
            out = self.model.score(hidden[torch.arange(len(batch)), last]).float()
        return [float(x) for x in out[:, 0]]


def _post_once(url: str, body: Any, timeout_s: float) -> Any:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return json.loads(resp.read().decode())


def _post(url: str, body: Any, timeout_s: float) -> Any:
    """``_post_once`` with a wall-clock bound of ``timeout_s`` (a socket timeout bounds each read only: a server
    that trickles bytes would hold it forever); the call runs on a daemon thread, left behind when it overruns."""
    out: List[Any] = []

    def call():
        try:
            out.append((True, _post_once(url, body, timeout_s)))
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            out.append((False, e))

    t = threading.Thread(target=call, daemon=True, name="reward.model-call")
    t.start()
    t.join(timeout_s)
    if not out:
        raise TimeoutError(f"no complete answer within {timeout_s:g} s")
    ok, value = out[0]
    if not ok:
        raise value
    return value


def parse_classify(answer: Any, n: int) -> List[float]:
    """The scores in SGLang's ``/classify`` answer to a batch of ``n``: a list of ``{"embedding": [score, ...]}``;
    ``ValueError`` saying what is wrong with any other answer."""
    if isinstance(answer, dict) and "error" in answer:
        raise ValueError(f"the server answered an error: {str(answer['error'])[:200]}")
    if not isinstance(answer, list) or len(answer) != n:
        got = f"a list of {len(answer)}" if isinstance(answer, list) else type(answer).__name__
        raise ValueError(f"malformed answer: expected a list of {n} results, got {got}")
    out = []
    for i, item in enumerate(answer):
        emb = item.get("embedding") if isinstance(item, dict) else None
        if not isinstance(emb, list) or not emb or not isinstance(emb[0], (int, float)) or isinstance(emb[0], bool) \
                or not math.isfinite(emb[0]):
            raise ValueError(f"malformed answer: result {i} has no finite 'embedding'[0] score "
                             f"({str(item)[:120]})")
        out.append(float(emb[0]))
    return out


class SGLangRM:
    """SGLang RM servers, round-robin, one ``/classify`` request per batch, ``retries`` further tries."""

    def __init__(self, urls: Sequence[str], timeout_s: float, retries: int):
        self.urls = [u.rstrip("/") for u in urls]
        self.timeout_s, self.retries = float(timeout_s), int(retries)
        self._turn = itertools.count()
        self._lock = threading.Lock()

    def _next_url(self) -> str:
        with self._lock:
            return self.urls[next(self._turn) % len(self.urls)]

    def scores(self, batch: Sequence[Sequence[int]]) -> List[float]:
        """Scores of ``batch`` from the next server; ``RMError`` naming every try after the last one fails."""
        tries, timeouts = [], 0
        for _ in range(self.retries + 1):
            url = self._next_url()
            try:
                return parse_classify(_post(url + "/classify", {"input_ids": [list(s) for s in batch]},
                                            self.timeout_s), len(batch))
            except (socket.timeout, TimeoutError) as e:
                timeouts += 1
                tries.append(f"{url}: no answer within reward.model.timeout_s={self.timeout_s:g} ({e})")
            except urllib.error.HTTPError as e:
                tries.append(f"{url}: HTTP {e.code} {e.read()[:200]!r}")
            except urllib.error.URLError as e:
                if isinstance(e.reason, (socket.timeout, TimeoutError)):
                    timeouts += 1
                tries.append(f"{url}: {e.reason}")
            except (OSError, ValueError) as e:
                tries.append(f"{url}: {type(e).__name__}: {e}")
        raise RMError(f"reward.model: a batch of {len(batch)} samples failed after {len(tries)} tries: "
                      + "; ".join(tries), timed_out=timeouts == len(tries))

    def model_info(self, url: str) -> Any:
        """The server's ``/model_info`` (``check``: is it a reward / embedding server?)."""
        with urllib.request.urlopen(url.rstrip("/") + "/model_info", timeout=self.timeout_s) as resp:
            return json.loads(resp.read().decode())
