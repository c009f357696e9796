"""Where a configuration runs: the in-process engine (`LLM`) or a running server (`--url`).

A runner takes a group of requests (a whole wave, or one request when requests are sent one at a
time), runs it to completion and returns one `RequestResult` per request. `drive` walks a recipe's
waves through all runners in lockstep, records each one's answers for its next wave and keeps a
progress bar.

TTFT in-process is `RequestOutput.metrics.ttft`: from submission (`LLMEngine.prepare`) to the step
that sampled the first token, so requests submitted together include their queueing. Over HTTP it
is the time from sending the streaming request to its first chunk with text.
"""

from __future__ import annotations

import gc
import os
import random
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from tqdm import tqdm

from recap.bench.workloads import BenchRequest, Recipe, TokenSpace
from recap.sampling_params import SamplingParams

WARMUP_SALT = "recap-bench-warmup"


@dataclass(frozen=True)
class ConfigSpec:
    """One column of the comparison."""

    name: str
    kind: str  # "engine" | "hf" | "url"
    caching: bool = True
    policy: str = "recap"
    segments: bool = True  # send segment boundaries (message ends) with each request
    url: str | None = None
    description: str = ""
    tier: str | None = None  # "host" or "disk": a lower cache tier below the read pools (docs/tiers.md)


CONFIGS: dict[str, ConfigSpec] = {
    "off": ConfigSpec("off", "engine", caching=False, policy="none", description="prefix caching off"),
    "align": ConfigSpec("align", "engine", policy="align", description="checkpoint at the prompt end only"),
    "all": ConfigSpec("all", "engine", policy="all", description="checkpoint at every block boundary"),
    "recap": ConfigSpec("recap", "engine", policy="recap", description="recap policy with segment boundaries"),
    "recap-noseg": ConfigSpec(
        "recap-noseg", "engine", policy="recap", segments=False, description="recap policy, no segment boundaries sent"
    ),
    "recap-host": ConfigSpec("recap-host", "engine", policy="recap", tier="host",
                             description="recap policy with a host-memory tier (--cache-host-bytes)"),
    "recap-disk": ConfigSpec("recap-disk", "engine", policy="recap", tier="disk",
                             description="recap policy with a disk tier (--cache-dir/<config>, --cache-disk-bytes)"),
    "hf": ConfigSpec("hf", "hf", caching=False, description="transformers generate, whole prompt each request"),
}


@dataclass(frozen=True)
class EngineOptions:
    model: str | None = None
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 32
    max_model_len: int = 4096
    kv_cache_bytes: int | None = None
    state_cache_bytes: int | None = None
    threads: int = 2
    seed: int = 0
    cache_dir: str | None = None  # tier configs: the disk tier under <cache_dir>/<config name>
    cache_host_bytes: int | None = None
    cache_disk_bytes: int | None = None

    def tier_kwargs(self, spec: ConfigSpec) -> dict[str, Any]:
        """The LLM arguments of the config's lower tier (none without one)."""
        if spec.tier == "host":
            return {"cache_host_bytes": self.cache_host_bytes}
        if spec.tier == "disk":
            if self.cache_dir is None:
                raise ValueError(f"config {spec.name} needs --cache-dir")
            return {"cache_dir": os.path.join(self.cache_dir, spec.name), "cache_disk_bytes": self.cache_disk_bytes}
        return {}


@dataclass
class RequestResult:
    rid: str
    session: int
    step: int
    wave: int
    prompt_ids: list[int]
    output_ids: list[int]
    cached_tokens: int
    ttft: float
    latency: float

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)


@dataclass
class CacheReport:
    """Checkpoint accounting of one configuration (None where the runner cannot see it)."""

    checkpoint_bytes: int | None = None  # held at the end of the run
    peak_checkpoint_bytes: int | None = None  # largest seen between groups
    checkpoints: int | None = None
    checkpoints_created: int | None = None
    checkpoint_evictions: int | None = None
    pools: dict[str, Any] = field(default_factory=dict)


class Runner(Protocol):
    spec: ConfigSpec

    def warmup(self) -> None: ...
    def run(self, group: Sequence[BenchRequest], wave: int) -> list[RequestResult]: ...
    def cache_report(self) -> CacheReport: ...
    def close(self) -> None: ...


def sampling(r: BenchRequest) -> SamplingParams:
    seed = None if r.temperature == 0 else random.Random(r.rid).randrange(2**31)
    return SamplingParams(temperature=r.temperature, max_tokens=r.max_tokens, ignore_eos=True, seed=seed)


class EngineRunner:
    """One `LLM` for one configuration; requests of a group are submitted together."""

    def __init__(self, spec: ConfigSpec, opts: EngineOptions) -> None:
        from recap.engine.llm import LLM

        self.spec = spec
        self.llm = LLM(
            opts.model,
            seed=opts.seed,
            enable_prefix_caching=spec.caching,
            checkpoint_policy=spec.policy,
            block_size=opts.block_size,
            max_num_batched_tokens=opts.max_num_batched_tokens,
            max_num_seqs=opts.max_num_seqs,
            max_model_len=opts.max_model_len,
            kv_cache_bytes=opts.kv_cache_bytes,
            state_cache_bytes=opts.state_cache_bytes,
            num_threads=opts.threads,
            **opts.tier_kwargs(spec),
        )
        self.engine = self.llm.engine
        self._base_bytes = 0
        self._base_count = self._base_created = self._base_evicted = 0
        self._peak = 0

    def warmup(self) -> None:
        """One short request under its own cache salt, so it shares nothing with the workload."""
        rng = random.Random(1)
        ids = [rng.randrange(16, 256) for _ in range(48)]
        self.llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), cache_salt=WARMUP_SALT)
        snap = self.engine.metrics_snapshot()
        self._base_bytes, self._base_created = snap.checkpoint_bytes, snap.checkpoints_created
        self._base_evicted, self._base_count = snap.checkpoint_evictions, snap.checkpoints

    def run(self, group: Sequence[BenchRequest], wave: int) -> list[RequestResult]:
        eng = self.engine
        prepared = []
        for r in group:
            segs = r.segments if self.spec.segments else ()
            prepared.append(eng.prepare(r.prompt, sampling(r), segment_boundaries=segs))
        for p in prepared:
            eng.add_prepared(p)
        done: dict[str, Any] = {}
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished:
                    done[out.request_id] = out
        self._peak = max(self._peak, eng.metrics_snapshot().checkpoint_bytes - self._base_bytes)
        results = []
        for r, p in zip(group, prepared):
            out = done[p.request_id]
            m = out.metrics
            results.append(
                RequestResult(
                    r.rid,
                    r.session,
                    r.step,
                    wave,
                    list(r.prompt),
                    list(out.outputs[0].token_ids),
                    out.num_cached_tokens,
                    float(m.ttft),
                    float(m.finished_time - m.arrival_time),
                )
            )
        return results

    def cache_report(self) -> CacheReport:
        snap = self.engine.metrics_snapshot()
        layout = self.engine.runner.layout
        return CacheReport(
            checkpoint_bytes=max(0, snap.checkpoint_bytes - self._base_bytes),
            peak_checkpoint_bytes=self._peak,
            checkpoints=max(0, snap.checkpoints - self._base_count),
            checkpoints_created=snap.checkpoints_created - self._base_created,
            checkpoint_evictions=snap.checkpoint_evictions - self._base_evicted,
            pools={
                "num_kv_blocks": layout.num_kv_blocks,
                "num_state_slots": layout.num_state_slots,
                "state_bytes_per_slot": layout.state_bytes_per_slot,
                "kv_bytes_per_token": layout.kv_bytes_per_token,
            },
        )

    def close(self) -> None:
        del self.llm, self.engine
        gc.collect()


class UrlRunner:
    """A running recap (or any OpenAI-compatible) server through the official openai client.

    Prompts go as token ids to /v1/completions with `checkpoints` = segment boundaries (recap's
    extension) and `ignore_eos`; answers come back as text and are re-tokenized for the next turn.
    """

    def __init__(self, spec: ConfigSpec, concurrency: int, encode: Callable[[str], list[int]]) -> None:
        import openai

        assert spec.url is not None
        self.spec = spec
        self.base = spec.url.rstrip("/").removesuffix("/v1")
        self.client = openai.OpenAI(base_url=f"{self.base}/v1", api_key="unused", max_retries=0, timeout=3600)
        self.model = self.client.models.list().data[0].id
        self.concurrency = max(1, concurrency)
        self.encode = encode
        self._peak = 0

    def warmup(self) -> None:
        self.client.completions.create(
            model=self.model,
            prompt=list(range(16, 64)),
            max_tokens=2,
            temperature=0.0,
            extra_body={"cache_salt": WARMUP_SALT},
        )

    def _one(self, r: BenchRequest, wave: int) -> RequestResult:
        extra: dict[str, Any] = {"ignore_eos": True}
        if self.spec.segments and r.segments:
            extra["checkpoints"] = list(r.segments)
        t0 = time.monotonic()
        ttft, text, cached = None, [], 0
        stream = self.client.completions.create(
            model=self.model,
            prompt=r.prompt,
            max_tokens=r.max_tokens,
            temperature=r.temperature,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=extra,
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                ttft = time.monotonic() - t0 if ttft is None else ttft
                text.append(chunk.choices[0].text)
            details = getattr(chunk.usage, "prompt_tokens_details", None) if chunk.usage else None
            if details is not None and details.cached_tokens:
                cached = int(details.cached_tokens)
        latency = time.monotonic() - t0
        return RequestResult(
            r.rid,
            r.session,
            r.step,
            wave,
            list(r.prompt),
            self.encode("".join(text)),
            cached,
            latency if ttft is None else ttft,
            latency,
        )

    def run(self, group: Sequence[BenchRequest], wave: int) -> list[RequestResult]:
        with ThreadPoolExecutor(min(self.concurrency, len(group))) as pool:
            results = list(pool.map(lambda r: self._one(r, wave), group))
        self._peak = max(self._peak, self._metrics().get("recap:checkpoint_bytes", 0))
        return results

    def _metrics(self) -> dict[str, int]:
        import httpx
        from prometheus_client.parser import text_string_to_metric_families

        try:
            text = httpx.get(f"{self.base}/metrics", timeout=30).text
        except httpx.HTTPError:
            return {}
        return {s.name: int(s.value) for fam in text_string_to_metric_families(text) for s in fam.samples}

    def cache_report(self) -> CacheReport:
        m = self._metrics()
        return CacheReport(
            checkpoint_bytes=m.get("recap:checkpoint_bytes"),
            peak_checkpoint_bytes=self._peak or None,
            checkpoints=m.get("recap:checkpoints"),
            checkpoints_created=m.get("recap:checkpoints_created_total"),
            checkpoint_evictions=m.get("recap:checkpoint_evictions_total"),
        )

    def close(self) -> None:
        self.client.close()


@dataclass
class ConfigRun:
    spec: ConfigSpec
    results: list[RequestResult]
    wall_s: float  # time spent running this configuration's requests
    cache: CacheReport


@dataclass
class _Lane:
    runner: Runner
    submit: str
    keep: Callable[[BenchRequest], bool] | None
    waves: Iterator[list[BenchRequest]]
    answers: dict[str, list[int]]
    results: list[RequestResult] = field(default_factory=list)
    seconds: float = 0.0

    def next_groups(self) -> list[list[BenchRequest]] | None:
        full = next(self.waves, None)
        if full is None:
            return None
        wave = [r for r in full if self.keep is None or self.keep(r)]
        return ([wave] if wave else []) if self.submit == "wave" else [[r] for r in wave]


def drive(
    recipe: Recipe, space: TokenSpace, runners: dict[str, Runner], submit: dict[str, str],
    keep: dict[str, Callable[[BenchRequest], bool] | None], total: int,
) -> dict[str, ConfigRun]:
    """Run every configuration through the recipe in lockstep.

    Wave by wave, and inside a wave group by group (a group is the whole wave under `wave`
    submission, one request under `serial`), the configurations take turns, the first one rotating
    with each wave, so drift in the machine's load falls on all of them alike. Each configuration
    has its own answers (multi-turn prompts carry its own outputs) and its own clock: its wall time
    is the time spent in its own groups.
    """
    lanes = {n: _Lane(r, submit[n], keep.get(n), iter(()), {}) for n, r in runners.items()}
    for lane in lanes.values():
        lane.waves = recipe.waves(space, lane.answers)
    bar = tqdm(total=total, unit="req", leave=True)
    wave = 0
    while True:
        groups = {n: g for n, lane in lanes.items() if (g := lane.next_groups()) is not None}
        if not groups:
            break
        names = list(groups)
        order = names[wave % len(names):] + names[:wave % len(names)]
        for i in range(max(len(g) for g in groups.values())):
            for n in order:
                if i >= len(groups[n]):
                    continue
                lane = lanes[n]
                bar.set_postfix_str(n, refresh=False)
                t0 = time.perf_counter()
                res = lane.runner.run(groups[n][i], wave)
                lane.seconds += time.perf_counter() - t0
                for r in res:
                    lane.answers[r.rid] = r.output_ids
                lane.results += res
                bar.update(len(res))
        wave += 1
    bar.close()
    return {n: ConfigRun(lane.runner.spec, lane.results, lane.seconds, lane.runner.cache_report())
            for n, lane in lanes.items()}
