"""Money: what an inference span cost, from the model and provider it names and its token counts.

Prices come from the policy's own `prices:` (per model, USD per million tokens) or else from
genai-prices' bundled database (pydantic/genai-prices, a maintained price list shipped inside
the package). Only the bundled snapshot is read: nothing here starts genai-prices'
`UpdatePrices`, so pricing does no network or file I/O and a replay prices a span alike every
time (the span's own end time picks the price in force then).

Amounts are integers: pico-dollars (1e-12 USD) in the state, so a token of the cheapest model
still costs a whole number; decisions and signals carry micro-dollars (`cost_micro_usd`),
which every killswitch reads as a safe integer.

The database is the `prices` extra (`pip install "spanguard[prices]"`; the worker has it).
Without it only the policy's prices apply: a warning says so once, and every other model is
unpriced, counted as below.

A model neither the policy nor the database knows is never priced at zero silently: its tokens
are counted as unpriced (in the trace's state, in the decision's reason, in GuardStats, which the
worker exports), and a warning names it once per (provider, model).
"""

from __future__ import annotations

import importlib.util
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import ROUND_HALF_UP, Decimal
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from spanguard.detection.conventions.events import TokenUsage

__all__ = [
    "MICRO_USD_PER_USD",
    "PICO_USD_PER_USD",
    "ModelRates",
    "Pricer",
    "micro_usd",
    "pico_usd",
]

log = logging.getLogger("spanguard.core")

PICO_USD_PER_USD: Final = 10**12
MICRO_USD_PER_USD: Final = 10**6
# USD per million tokens -> pico-dollars per token: x 1e12 / 1e6.
_PICO_PER_TOKEN_PER_MTOK: Final = Decimal(10**6)
# Distinct (provider, model) pairs remembered: model names are outside input, the cache stays
# bounded whatever a fleet (or an attacker) writes there.
MAX_LOOKUPS: Final = 4096
# The per-token prices the simple path reads; anything else token-priced (tiers, a price per
# request) goes through genai-prices' own calculation.
_NANOS_PER_DAY: Final = 86_400 * 10**9
_TOKEN_PRICE_KEYS: Final = ("input_mtok", "output_mtok", "cache_read_mtok", "cache_write_mtok")


@lru_cache(maxsize=256)  # budgets are a handful of numbers, checked on every usage span
def pico_usd(usd: float | Decimal | str) -> int:
    """An amount in USD as whole pico-dollars."""
    return int((Decimal(str(usd)) * PICO_USD_PER_USD).to_integral_value(ROUND_HALF_UP))


def micro_usd(pico: int) -> int:
    """Pico-dollars as whole micro-dollars (rounded half up): what decisions carry."""
    return (pico + 500_000) // 1_000_000


@dataclass(frozen=True, slots=True)
class ModelRates:
    """One model's prices in pico-dollars per token (the policy's `prices:` are read into it).
    A cache rate of None is the input rate."""

    input: int
    output: int
    cache_read: int | None = None
    cache_write: int | None = None

    @classmethod
    def per_million(cls, settings: Mapping[str, Any]) -> ModelRates:
        """From the policy's shape: USD per million tokens (`input_mtok`, `output_mtok`,
        `cache_read_mtok`, `cache_write_mtok`)."""

        def rate(name: str) -> int | None:
            value = settings.get(name)
            if value is None:
                return None
            return int(
                (Decimal(str(value)) * _PICO_PER_TOKEN_PER_MTOK).to_integral_value(ROUND_HALF_UP)
            )

        return cls(
            input=rate("input_mtok") or 0,
            output=rate("output_mtok") or 0,
            cache_read=rate("cache_read_mtok"),
            cache_write=rate("cache_write_mtok"),
        )

    def cost(self, usage: TokenUsage) -> int:
        """Pico-dollars for one span's counts."""
        if not usage.cache_read_tokens and not usage.cache_write_tokens:  # most spans
            return usage.input_tokens * self.input + usage.output_tokens * self.output
        uncached, cache_read, cache_write = _input_parts(usage)
        read_rate = self.input if self.cache_read is None else self.cache_read
        write_rate = self.input if self.cache_write is None else self.cache_write
        return (
            uncached * self.input
            + cache_read * read_rate
            + cache_write * write_rate
            + usage.output_tokens * self.output
        )


def _input_parts(usage: TokenUsage) -> tuple[int, int, int]:
    """(uncached, cache read, cache write) input tokens. The conventions count cached tokens
    inside the input count; an instrumentation that reports them apart (cache counts larger
    than the input) has them added."""
    cache_read, cache_write = usage.cache_read_tokens, usage.cache_write_tokens
    total = usage.input_tokens
    if cache_read + cache_write > total:
        total += cache_read + cache_write
    return total - cache_read - cache_write, cache_read, cache_write


class _Unpriced:
    __slots__ = ()


_UNPRICED: Final = _Unpriced()


class Pricer:
    """Prices TokenUsage events (with a model) in pico-dollars; None when nothing knows the model.

    One per guard. What the database answers for a (provider, model) is looked up once and kept
    (bounded); a price in force at a span's time is turned into per-token rates once per price.
    """

    def __init__(self) -> None:
        # (provider, model) -> (provider, model info) of genai-prices, or _UNPRICED
        self._found: dict[tuple[str | None, str], Any] = {}
        # (id(model info), day of the span) -> (the model info, its ModelPrice that day, its
        # ModelRates or None when it needs the library's own calculation: tiers, a price per
        # request). Prices change by date: a day's answer stands for the whole day.
        self._rates: dict[tuple[int, int], tuple[Any, Any, ModelRates | None]] = {}
        self._warned: set[tuple[str | None, str | None]] = set()
        # (response model, request model, provider, day, which overrides) -> the per-token
        # rates that priced such a span: every inference span of a fleet names one of a few
        # models, so most are priced from here (bounded as the lookups are).
        self._known: dict[tuple[str | None, str | None, str | None, int, int], ModelRates] = {}
        self.has_database = importlib.util.find_spec("genai_prices") is not None
        self.unpriced_events = 0  # inference spans with usage that nothing could price
        self.priced_events = 0

    def cost(
        self, usage: TokenUsage, overrides: Mapping[str, ModelRates] | None = None
    ) -> int | None:
        """The span's cost in pico-dollars, or None (warned once, counted) when its model has
        no price: not in the policy's `prices:`, not in the database, or not named at all."""
        ended = usage.end_time_unix_nano if usage.end_time_unix_nano > 0 else time.time_ns()
        known_key = (
            usage.response_model,
            usage.request_model,
            usage.provider,
            ended // _NANOS_PER_DAY,
            id(overrides) if overrides else 0,
        )
        known = self._known.get(known_key)
        if known is not None:
            self.priced_events += 1
            return known.cost(usage)
        models = [name for name in (usage.response_model, usage.request_model) if name]
        if overrides:
            for name in models:
                rates = overrides.get(name.lower())
                if rates is not None:
                    self.priced_events += 1
                    self._remember(known_key, rates)
                    return rates.cost(usage)
        for name in models:
            found = self._lookup(usage.provider, name)
            if found is not _UNPRICED:
                self.priced_events += 1
                return self._database_cost(found, usage, ended, known_key)
        self.unpriced_events += 1
        self._warn(usage.provider, models[0] if models else None)
        return None

    def _lookup(self, provider: str | None, model: str) -> Any:
        key = (provider, model)
        found = self._found.get(key)
        if found is not None:
            return found
        if not self.has_database:
            return _UNPRICED
        from genai_prices import data_snapshot  # a 1.6 MB table: loaded when first needed

        snapshot = data_snapshot.get_snapshot()
        found = _UNPRICED
        # The provider as named (genai-prices knows the conventions' names: gcp.gemini,
        # aws.bedrock, openai.chat), else any provider whose models match the name.
        for provider_id in (provider, None) if provider else (None,):
            try:
                found = snapshot.find_provider_model(model, None, provider_id, None)
                break
            except LookupError:
                continue
        if len(self._found) >= MAX_LOOKUPS:
            self._found.clear()
        self._found[key] = found
        return found

    def _remember(
        self, key: tuple[str | None, str | None, str | None, int, int], rates: ModelRates
    ) -> None:
        if len(self._known) >= MAX_LOOKUPS:
            self._known.clear()
        self._known[key] = rates

    def _database_cost(
        self,
        found: tuple[Any, Any],
        usage: TokenUsage,
        ended: int,
        known_key: tuple[str | None, str | None, str | None, int, int],
    ) -> int:
        _provider, model = found
        key = (id(model), ended // _NANOS_PER_DAY)
        entry = self._rates.get(key)
        if entry is None or entry[0] is not model:
            price = model.get_prices(datetime.fromtimestamp(ended / 1e9, UTC))
            entry = (model, price, _simple_rates(price))
            if len(self._rates) >= MAX_LOOKUPS:
                self._rates.clear()
            self._rates[key] = entry
        price, rates = entry[1], entry[2]
        if rates is not None:
            self._remember(known_key, rates)
            return rates.cost(usage)
        from genai_prices import Usage

        uncached, cache_read, cache_write = _input_parts(usage)
        total = price.calc_price(
            Usage(
                input_tokens=uncached + cache_read + cache_write,
                cache_read_tokens=cache_read,
                cache_write_tokens=cache_write,
                output_tokens=usage.output_tokens,
            )
        )["total_price"]
        return pico_usd(total)

    def _warn(self, provider: str | None, model: str | None) -> None:
        if (provider, model) in self._warned:
            return
        if len(self._warned) < MAX_LOOKUPS:
            self._warned.add((provider, model))
        if model is None:
            log.warning(
                "inference spans of provider %r name no model (gen_ai.request.model,"
                " gen_ai.response.model, llm.model_name): their tokens are counted as unpriced,"
                " not as free",
                provider,
            )
            return
        if not self.has_database:
            log.warning(
                "no price for model %r (provider %r): genai-prices is not installed"
                ' (pip install "spanguard[prices]") and the policy gives no price for it; its'
                " tokens are counted as unpriced, not as free",
                model,
                provider,
            )
            return
        log.warning(
            "no price for model %r (provider %r) in genai-prices' database: its tokens are"
            " counted as unpriced, not as free; give it a price in the policy"
            " (prices: {%s: {input_mtok: ..., output_mtok: ...}}, USD per million tokens)",
            model,
            provider,
            model,
        )


def _simple_rates(price: Any) -> ModelRates | None:
    """Per-token rates of a price made of flat token prices; None for tiers or a per-request
    price (genai-prices' own calculation handles those)."""
    if getattr(price, "requests_kusd", None) is not None:
        return None
    values = {}
    for key in _TOKEN_PRICE_KEYS:
        value = getattr(price, key, None)
        if value is not None and not isinstance(value, Decimal):
            return None
        values[key] = value
    return ModelRates.per_million(values)
