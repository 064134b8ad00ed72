"""DeepSpeed configs as people have them: the Hugging Face Trainer's "auto" values, the
``scheduler`` section, the optimizer built from both, and DeepSpeed's legacy keys.

The schedules are checked step by step against a plain-Python copy of DeepSpeed's
formulas (``deepspeed/runtime/lr_schedules.py``) driven in DeepSpeed's order: the
scheduler's constructor sets the rate of the first optimizer step, and the engine
(``DeepSpeedEngine._take_model_step``) calls ``lr_scheduler.step()`` after each step.
"""

import json
import math

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax as zj
from zerojax import cli
from zerojax.deepspeed import translate
from zerojax.optim import schedules

# --- DeepSpeed's schedulers, in plain Python floats ----------------------------------------
# Each keeps the optimizer's learning rate in ``lr`` as DeepSpeed's update_lr sets it: in
# the constructor (last_batch_iteration -1), then in step().


class RefWarmupLR:
    def __init__(self, warmup_min_lr=0.0, warmup_max_lr=0.001, warmup_num_steps=1000, warmup_type="log"):
        self.min_lr, self.max_lr = warmup_min_lr, warmup_max_lr
        self.delta_lr = warmup_max_lr - warmup_min_lr
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        self.last_batch_iteration = -1
        self.lr = self.get_lr()

    def get_lr(self):
        if self.last_batch_iteration < 0:
            return self.min_lr
        return self.min_lr + self.delta_lr * self._get_gamma()

    def _warmup_gamma(self):
        if self.warmup_type == "log":
            return self.inverse_log_warm_up * math.log(self.last_batch_iteration + 1)
        return self.last_batch_iteration / self.warmup_num_steps

    def _get_gamma(self):
        if self.last_batch_iteration < self.warmup_num_steps:
            return self._warmup_gamma()
        return 1.0

    def step(self, batch_iteration=None):
        self.last_batch_iteration = self.last_batch_iteration + 1 if batch_iteration is None else batch_iteration
        self.lr = self.get_lr()


class RefWarmupDecayLR(RefWarmupLR):
    def __init__(
        self, total_num_steps, warmup_min_lr=0.0, warmup_max_lr=0.001, warmup_num_steps=1000, warmup_type="log"
    ):
        self.total_num_steps = total_num_steps
        super().__init__(warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type)

    def _get_gamma(self):
        if self.last_batch_iteration < self.warmup_num_steps:
            return self._warmup_gamma()
        return max(
            0.0,
            float(self.total_num_steps - self.last_batch_iteration)
            / float(max(1.0, self.total_num_steps - self.warmup_num_steps)),
        )


class RefWarmupCosineLR:
    def __init__(
        self, total_num_steps, lr, warmup_min_ratio=0.0, warmup_num_steps=1000, cos_min_ratio=0.0001, warmup_type="log"
    ):
        self.total_num_steps, self.org_lr = total_num_steps, lr
        self.warmup_min_ratio, self.cos_min_ratio, self.warmup_type = warmup_min_ratio, cos_min_ratio, warmup_type
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        self.last_batch_iteration = -1
        self.lr = self.get_lr()

    def get_lr_ratio(self):
        if self.last_batch_iteration < 0:
            return 0.0
        if self.last_batch_iteration < self.warmup_num_steps:
            if self.warmup_type == "log":
                ratio = self.inverse_log_warm_up * math.log(self.last_batch_iteration + 1)
            else:
                ratio = self.last_batch_iteration / self.warmup_num_steps
            return self.warmup_min_ratio + ratio * (1.0 - self.warmup_min_ratio)
        real_last_step = self.last_batch_iteration - self.warmup_num_steps + 1
        real_total_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        cosine_progress = min(1.0, real_last_step / real_total_steps)
        ratio = (1 + math.cos(math.pi * cosine_progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * ratio)

    def get_lr(self):
        if self.last_batch_iteration < 0:
            return 0.0
        return self.org_lr * self.get_lr_ratio()

    step = RefWarmupLR.step


class RefOneCycle:
    def __init__(
        self,
        cycle_min_lr,
        cycle_max_lr,
        decay_lr_rate=0.0,
        cycle_first_step_size=2000,
        cycle_second_step_size=None,
        cycle_first_stair_count=0,
        cycle_second_stair_count=None,
        decay_step_size=0,
        cycle_min_mom=0.8,
        cycle_max_mom=0.9,
        decay_mom_rate=0.0,
    ):
        first = float(cycle_first_step_size)
        second = float(cycle_second_step_size) if cycle_second_step_size is not None else first
        self.total_size = first + second
        self.step_ratio = first / self.total_size
        self.first_step_size, self.second_step_size = first, second
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = (
            cycle_first_stair_count if cycle_second_stair_count is None else cycle_second_stair_count
        )
        self.decay_step_size = decay_step_size
        self.skip_lr_decay = self.skip_mom_decay = math.isclose(decay_step_size, 0)
        self.min_lr, self.max_lr, self.decay_lr_rate = cycle_min_lr, cycle_max_lr, decay_lr_rate
        self.skip_lr_decay = self.skip_lr_decay or math.isclose(decay_lr_rate, 0)
        self.min_mom, self.max_mom, self.decay_mom_rate = cycle_min_mom, cycle_max_mom, decay_mom_rate
        self.skip_mom_decay = self.skip_mom_decay or math.isclose(decay_mom_rate, 0)
        self.last_batch_iteration = -1
        self.lr, self.mom = self.min_lr, self.min_mom  # the constructor's update_lr and betas

    def _get_scale_factor(self):
        batch_iteration = self.last_batch_iteration + 1
        cycle = math.floor(1 + batch_iteration / self.total_size)
        x = 1.0 + batch_iteration / self.total_size - cycle
        if x <= self.step_ratio:
            scale_factor, stair_count = x / self.step_ratio, self.first_stair_count
        else:
            scale_factor, stair_count = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stair_count > 0:
            cycle_iteration = batch_iteration % self.total_size
            if cycle_iteration <= self.first_step_size:
                stair_position = cycle_iteration * stair_count / self.first_step_size
            else:
                stair_position = (self.total_size - cycle_iteration) * stair_count / self.second_step_size
            scale_factor = math.floor(stair_position) / stair_count
        return scale_factor

    def get_lr(self):
        if self.last_batch_iteration < self.total_size:
            return self.min_lr + (self.max_lr - self.min_lr) * self._get_scale_factor()
        if self.skip_lr_decay:
            return self.min_lr
        decay_interval = (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size
        return self.min_lr / (1 + self.decay_lr_rate * decay_interval)

    def get_mom(self):
        if self.last_batch_iteration < self.total_size:
            return self.max_mom - (self.max_mom - self.min_mom) * self._get_scale_factor()
        if self.skip_mom_decay:
            return self.max_mom
        decay_interval = (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size
        return self.max_mom * (1 + self.decay_mom_rate * decay_interval)

    def step(self, batch_iteration=None):
        self.last_batch_iteration = self.last_batch_iteration + 1 if batch_iteration is None else batch_iteration
        self.lr, self.mom = self.get_lr(), self.get_mom()


class RefLRRangeTest:
    def __init__(
        self,
        lr_range_test_min_lr=1e-3,
        lr_range_test_step_size=2000,
        lr_range_test_step_rate=1.0,
        lr_range_test_staircase=False,
    ):
        self.min_lr, self.step_size, self.step_rate = (
            lr_range_test_min_lr,
            lr_range_test_step_size,
            lr_range_test_step_rate,
        )
        self.staircase = lr_range_test_staircase
        self.last_batch_iteration = -1
        self.lr = self.min_lr

    def get_lr(self):
        interval = float(self.last_batch_iteration + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        return self.min_lr * (1 + self.step_rate * interval)

    step = RefWarmupLR.step


def engine_rates(scheduler, steps, attr="lr"):
    """The rate each optimizer step 0..steps-1 runs at: the engine steps the optimizer at
    the current rate, then calls lr_scheduler.step()."""
    rates = []
    for _ in range(steps):
        rates.append(getattr(scheduler, attr))
        scheduler.step()
    return rates


def rate_at(make, step, attr="lr"):
    """The rate of optimizer step ``step`` (>= 1): the scheduler at iteration step - 1."""
    scheduler = make()
    scheduler.step(step - 1)
    return getattr(scheduler, attr)


CASES = [
    ("WarmupLR", {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 20}),
    ("WarmupLR", {"warmup_min_lr": 1e-5, "warmup_max_lr": 3e-4, "warmup_num_steps": 30, "warmup_type": "linear"}),
    ("WarmupLR", {"warmup_min_lr": 2e-4, "warmup_max_lr": 1e-3, "warmup_num_steps": 1}),  # max(2, 1) steps
    ("WarmupDecayLR", {"total_num_steps": 80, "warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 10}),
    (
        "WarmupDecayLR",
        {
            "total_num_steps": 60,
            "warmup_min_lr": 1e-5,
            "warmup_max_lr": 5e-4,
            "warmup_num_steps": 25,
            "warmup_type": "linear",
        },
    ),
    ("WarmupDecayLR", {"total_num_steps": 6, "warmup_max_lr": 1e-2, "warmup_num_steps": 10}),  # total < warm-up
    ("WarmupCosineLR", {"total_num_steps": 80, "warmup_num_steps": 10}),
    (
        "WarmupCosineLR",
        {
            "total_num_steps": 70,
            "warmup_min_ratio": 0.1,
            "warmup_num_steps": 15,
            "cos_min_ratio": 0.05,
            "warmup_type": "linear",
        },
    ),
    ("WarmupCosineLR", {"total_num_steps": 10, "warmup_num_steps": 10, "cos_min_ratio": 0.2}),  # no decay window
    (
        "OneCycle",
        {
            "cycle_min_lr": 1e-4,
            "cycle_max_lr": 1e-3,
            "cycle_first_step_size": 10,
            "decay_lr_rate": 0.5,
            "decay_step_size": 5,
        },
    ),
    (
        "OneCycle",
        {
            "cycle_min_lr": 0.01,
            "cycle_max_lr": 0.1,
            "cycle_first_step_size": 12,
            "cycle_second_step_size": 8,
            "cycle_first_stair_count": 4,
            "cycle_second_stair_count": 2,
        },
    ),
    (
        "OneCycle",
        {
            "cycle_min_lr": 0.01,
            "cycle_max_lr": 0.1,
            "cycle_first_step_size": 7,
            "cycle_second_step_size": 0,
            "cycle_first_stair_count": 3,
            "decay_lr_rate": 0.1,
            "decay_step_size": 2,
        },
    ),
    ("LRRangeTest", {"lr_range_test_min_lr": 1e-4, "lr_range_test_step_size": 10}),
    (
        "LRRangeTest",
        {
            "lr_range_test_min_lr": 1e-3,
            "lr_range_test_step_size": 7,
            "lr_range_test_step_rate": 5.0,
            "lr_range_test_staircase": True,
        },
    ),
]
REFERENCE = {
    "WarmupLR": RefWarmupLR,
    "WarmupDecayLR": RefWarmupDecayLR,
    "OneCycle": RefOneCycle,
    "LRRangeTest": RefLRRangeTest,
}
OPT_LR = 3e-4  # WarmupCosineLR scales the optimizer's lr


def reference(kind, params):
    if kind == "WarmupCosineLR":
        return lambda: RefWarmupCosineLR(lr=OPT_LR, **params)
    return lambda: REFERENCE[kind](**params)


def ours(kind, params):
    extra = {"learning_rate": OPT_LR} if kind == "WarmupCosineLR" else {}
    return schedules.DEEPSPEED_SCHEDULERS[kind](**params, **extra)


@pytest.mark.parametrize("kind,params", CASES, ids=[f"{k}-{i}" for i, (k, _) in enumerate(CASES)])
def test_schedules_give_deepspeeds_rate_at_every_optimizer_step(kind, params):
    make, schedule = reference(kind, params), ours(kind, params)
    steps, far = 60, [250, 1001, 20_000]  # the first steps, past the end of every case's schedule, far past it
    expected = engine_rates(make(), steps) + [rate_at(make, k) for k in far]
    got = schedule(jnp.asarray(list(range(steps)) + far))
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    "params",
    [c for k, c in CASES if k == "OneCycle"]
    + [
        {
            "cycle_min_lr": 0.1,
            "cycle_max_lr": 1.0,
            "cycle_first_step_size": 5,
            "cycle_min_mom": 0.85,
            "cycle_max_mom": 0.95,
            "decay_mom_rate": 0.1,
            "decay_step_size": 5,
        }
    ],
)
def test_one_cycle_momentum_is_deepspeeds_first_beta(params):
    make = lambda: RefOneCycle(**params)  # noqa: E731
    moms = {k: v for k, v in params.items() if k not in ("cycle_min_lr", "cycle_max_lr", "decay_lr_rate")}
    schedule = schedules.one_cycle_momentum(**moms)
    np.testing.assert_allclose(np.asarray(schedule(jnp.arange(60))), engine_rates(make(), 60, "mom"), rtol=1e-6)
    assert float(schedule(500)) == pytest.approx(rate_at(make, 500, "mom"), rel=1e-6)


def test_first_steps_follow_deepspeeds_stepping_order():
    """Optimizer step 0 runs at the constructor's rate, step k at iteration k - 1's: where
    those differ (the cosine's 0.0, OneCycle's bound) the first steps show it."""
    cosine = schedules.warmup_cosine_lr(
        total_num_steps=100, learning_rate=1.0, warmup_min_ratio=0.5, warmup_num_steps=10, warmup_type="linear"
    )
    np.testing.assert_allclose([float(cosine(k)) for k in range(3)], [0.0, 0.5, 0.55], rtol=1e-6)
    assert float(cosine(0)) == 0.0
    cycle = schedules.one_cycle(cycle_min_lr=0.0, cycle_max_lr=1.0, cycle_first_step_size=4)
    np.testing.assert_allclose([float(cycle(k)) for k in range(3)], [0.0, 0.25, 0.5])
    # WarmupLR with warmup_min_lr 0 runs its first two optimizer steps at 0.
    assert [float(schedules.warmup_lr(1e-3, warmup_num_steps=10)(k)) for k in range(3)][:2] == [0.0, 0.0]


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: schedules.warmup_lr(1e-3, warmup_num_steps=-1), r"warmup_num_steps must be a whole number >= 0"),
        (lambda: schedules.warmup_lr(1e-3, warmup_num_steps=2.5), r"warmup_num_steps must be a whole number"),
        (lambda: schedules.warmup_lr(1e-3, warmup_type="cosine"), r"warmup_type must be one of \('log', 'linear'\)"),
        (lambda: schedules.one_cycle(0.1, 1.0, cycle_first_step_size=0), r"cycle_first_step_size must be > 0"),
        (lambda: schedules.lr_range_test(lr_range_test_step_size=0), r"lr_range_test_step_size must be a whole number"),
    ],
)
def test_schedule_arguments_are_checked(call, match):
    with pytest.raises(ValueError, match=match):
        call()
    with pytest.raises(TypeError, match=r"warmup_max_lr must be a number, got 'auto'"):
        schedules.warmup_lr("auto")


# --- the optimizer: Translation.tx ---------------------------------------------------------


def run(tx, steps=5):
    """The parameters before and after each of ``steps`` updates, with fixed gradients."""
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32), "b": jnp.zeros((3,))}
    state = tx.init(params)
    history = [params]
    for _ in range(steps):
        grads = {k: jnp.asarray(rng.normal(size=v.shape), jnp.float32) for k, v in params.items()}
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        history.append(params)
    return history


def assert_same_run(tx, ref, steps=5):
    for got, want in zip(run(tx, steps), run(ref, steps)):
        for k in want:
            np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=1e-6, atol=1e-9)


def by_step(rates):
    """A schedule by hand: DeepSpeed's rates, looked up by the optimizer step count."""
    table = jnp.asarray(rates, jnp.float32)
    return lambda count: table[count]


def test_tx_is_adamw_with_the_warmup_schedule():
    """WarmupLR linear is optax.linear_schedule starting one step late; the first update
    (at warmup_min_lr 0) moves nothing."""
    t = translate(
        {
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.8, 0.99], "weight_decay": 0.1}},
            "scheduler": {
                "type": "WarmupLR",
                "params": {"warmup_max_lr": 1e-2, "warmup_num_steps": 4, "warmup_type": "linear"},
            },
            "gradient_clipping": 1.0,
        }
    )
    assert t.optimizer == (
        "optax.adamw(learning_rate=zj.optim.schedules.warmup_lr(warmup_max_lr=0.01, "
        "warmup_min_lr=0.0, warmup_num_steps=4, warmup_type='linear'), b1=0.8, b2=0.99, "
        "eps=1e-08, weight_decay=0.1)"
    )
    assert t.schedule == t.optimizer[len("optax.adamw(learning_rate=") : t.optimizer.index(", b1=")]
    ref = optax.adamw(
        optax.linear_schedule(0.0, 1e-2, 4, transition_begin=1), b1=0.8, b2=0.99, eps=1e-8, weight_decay=0.1
    )
    assert_same_run(t.tx, ref, steps=7)
    start, first = run(t.tx, 1)  # DeepSpeed's first step runs at warmup_min_lr = 0: nothing moves
    np.testing.assert_array_equal(np.asarray(first["w"]), np.asarray(start["w"]))
    assert_same_run(eval(t.optimizer, {"optax": optax, "zj": zj}), t.tx)  # the printed code is the same optimizer


def test_tx_is_classic_adam_with_one_cycle_momentum():
    """OneCycle sets Adam's betas to (momentum, 0.99) each step; adam_w_mode false adds the
    weight decay to the gradient."""
    params = {
        "cycle_min_lr": 1e-3,
        "cycle_max_lr": 1e-2,
        "cycle_first_step_size": 2,
        "cycle_min_mom": 0.85,
        "cycle_max_mom": 0.95,
    }
    t = translate(
        {
            "optimizer": {
                "type": "Adam",
                "params": {"lr": 1e-2, "weight_decay": 0.01, "adam_w_mode": False, "betas": [0.5, 0.5]},
            },
            "scheduler": {"type": "OneCycle", "params": params},
            "gradient_clipping": 0,
        }
    )
    assert "optax.inject_hyperparams(optax.adam)(" in t.optimizer and "b2=0.99" in t.optimizer
    assert any("cycle_momentum" in n for n in t.notes)
    steps = 6
    lrs, moms = engine_rates(RefOneCycle(**params), steps), engine_rates(RefOneCycle(**params), steps, "mom")
    ref = optax.chain(
        optax.add_decayed_weights(0.01),
        optax.inject_hyperparams(optax.adam)(learning_rate=by_step(lrs), b1=by_step(moms), b2=0.99, eps=1e-8),
    )
    assert_same_run(t.tx, ref, steps)


def test_tx_is_sgd_with_the_decay_schedule():
    params = {"total_num_steps": 6, "warmup_min_lr": 0.01, "warmup_max_lr": 0.1, "warmup_num_steps": 3}
    t = translate(
        {
            "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
            "scheduler": {"type": "WarmupDecayLR", "params": params},
            "gradient_clipping": 1.0,
        }
    )
    ref = optax.sgd(by_step(engine_rates(RefWarmupDecayLR(**params), 8)), momentum=0.9)
    assert_same_run(t.tx, ref, steps=8)
    # OneCycle's momentum does not apply to SGD (no betas), in DeepSpeed and here.
    t = translate(
        {
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "gradient_clipping": 1.0,
            "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1}},
        }
    )
    assert "inject_hyperparams" not in t.optimizer and any("turns it off for SGD" in n for n in t.notes)


def test_tx_without_a_schedule_and_without_an_optimizer():
    t = translate({"optimizer": {"type": "Lion", "params": {"lr": 1e-4}}, "gradient_clipping": 1.0})
    assert_same_run(t.tx, optax.lion(1e-4, b1=0.9, b2=0.999, weight_decay=0.0), steps=3)
    t = translate(
        {"gradient_clipping": 1.0, "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 100}}}
    )
    assert t.tx is None and t.optimizer is None
    assert t.schedule == (
        "zj.optim.schedules.warmup_decay_lr(total_num_steps=100, warmup_min_lr=0.0, "
        "warmup_max_lr=0.001, warmup_num_steps=1000, warmup_type='log')"
    )
    assert any("pass Translation.schedule as your optimizer's learning_rate" in n for n in t.notes)


def test_scheduler_params_taken_from_the_optimizer():
    """WarmupLR without warmup_max_lr warms up to the optimizer's lr (DeepSpeed >= 0.17.2);
    WarmupCosineLR scales it. Without an optimizer section neither translates."""
    t = translate(
        {
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}},
            "gradient_clipping": 1.0,
            "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}},
        }
    )
    assert "warmup_max_lr=0.0003" in t.optimizer and any("0.17.2" in n for n in t.notes)
    t = translate(
        {
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}},
            "gradient_clipping": 1.0,
            "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 50}},
        }
    )
    assert "warmup_cosine_lr(total_num_steps=50, learning_rate=0.0003" in t.optimizer
    for kind, params in (("WarmupLR", {}), ("WarmupCosineLR", {"total_num_steps": 50})):
        t = translate({"gradient_clipping": 1.0, "scheduler": {"type": kind, "params": params}})
        assert t.schedule is None and "no optimizer section" in t.unmapped["scheduler"]


def test_schedulers_not_translated_are_named_with_the_optax_to_write():
    t = translate(
        {
            "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "scheduler": {"type": "StepLR", "params": {"step_size": 10, "gamma": 0.5}},
        }
    )
    assert (
        "optax.exponential_decay(lr, transition_steps=step_size, decay_rate=gamma, staircase=True)"
        in t.unmapped["scheduler"]
    )
    assert t.optimizer.startswith("optax.adamw(learning_rate=0.001,")  # the optimizer stays, at its lr
    t = translate(
        {
            "gradient_clipping": 1.0,
            "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 100, "warmup_max_lr": [1e-3, 1e-4]}},
        }
    )
    assert "one value per parameter group" in t.unmapped["scheduler"]
    t = translate(
        {"gradient_clipping": 1.0, "scheduler": {"type": "LRRangeTest", "params": {"last_batch_iteration": 99}}}
    )
    assert "resumes the schedule part-way" in t.unmapped["scheduler"]


@pytest.mark.parametrize(
    "scheduler,match",
    [
        ({"type": "warmuplr"}, r"'scheduler.type' is 'warmuplr', which DeepSpeed refuses"),
        (
            {"type": "WarmupLR", "params": {"total_num_steps": 10}},
            r"\['total_num_steps'\], which WarmupLR does not take",
        ),
        ({"type": "WarmupDecayLR", "params": {}}, r"needs scheduler.params.total_num_steps"),
        ({"type": "OneCycle", "params": {"cycle_min_lr": 0.1}}, r"needs scheduler.params.cycle_max_lr"),
        ({"params": {}}, r"'scheduler' needs a 'type'"),
        (
            {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-3, "warmup_num_steps": 2.5}},
            r"'scheduler.params.warmup_num_steps' must be a whole number",
        ),
    ],
)
def test_scheduler_sections_deepspeed_refuses(scheduler, match):
    with pytest.raises(ValueError, match=match):
        translate({"gradient_clipping": 1.0, "scheduler": scheduler})


def test_warmup_quirks_are_named():
    t = translate(
        {
            "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 0, "warmup_type": "exp"}},
        }
    )
    text = t.message()
    assert "0.19.3 and later refuse it" in text and "'exp' is neither 'log' nor 'linear'" in text
    assert "warmup_type='log'" in t.optimizer


# --- "auto" values -------------------------------------------------------------------------

# The Hugging Face Trainer's ZeRO-3 template (transformers tests/deepspeed/ds_config_zero3.json,
# as the DeepSpeed integration guide shows it): "auto" everywhere, the scheduler WarmupLR, and
# the legacy name stage3_gather_fp16_weights_on_model_save.
HF_ZERO3 = {
    "fp16": {
        "enabled": "auto",
        "loss_scale": 0,
        "loss_scale_window": 1000,
        "initial_scale_power": 16,
        "hysteresis": 2,
        "min_loss_scale": 1,
    },
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"},
    },
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e14,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_fp16_weights_on_model_save": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}
# The same with the guide's WarmupDecayLR section, whose total_num_steps the Trainer computes.
HF_ZERO3_DECAY = {
    **HF_ZERO3,
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {
            "total_num_steps": "auto",
            "warmup_min_lr": "auto",
            "warmup_max_lr": "auto",
            "warmup_num_steps": "auto",
        },
    },
}


def test_hf_zero3_template_fills_every_auto_value_from_the_trainers_defaults():
    t = translate(HF_ZERO3)
    resolved = {k: (v, source) for k, v, source in t.resolved}
    assert {k: v for k, (v, _) in resolved.items()} == {
        "fp16.enabled": False,
        "optimizer.params.lr": 5e-5,
        "optimizer.params.betas": [0.9, 0.999],
        "optimizer.params.eps": 1e-8,
        "optimizer.params.weight_decay": 0.0,
        "scheduler.params.warmup_min_lr": 0,
        "scheduler.params.warmup_max_lr": 5e-5,
        "scheduler.params.warmup_num_steps": 0,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "train_micro_batch_size_per_gpu": 8,
    }
    assert resolved["optimizer.params.lr"][1] == "HF Trainer default (TrainingArguments.learning_rate = 5e-05)"
    assert resolved["scheduler.params.warmup_min_lr"][1] == "HF Trainer fills 0 (not a TrainingArguments field)"
    text = t.message()
    for key in resolved:
        assert f"  {key} = " in text
    # Not used by zerojax, and needing the world size or the model's hidden size: left, and said so.
    assert (
        "zero_optimization.reduce_bucket_size, zero_optimization.stage3_prefetch_bucket_size, "
        'zero_optimization.stage3_param_persistence_threshold are "auto" and left so'
    ) in text
    assert 'train_batch_size is "auto" and left so' in text and "auto={'world_size': N}" in text
    assert t.config == zj.ZeroConfig(
        stage=3, grad_clip=1.0, offload={"optimizer": True, "params": True, "group_size": 10**14}
    )
    assert t.optimizer == (
        "optax.adamw(learning_rate=zj.optim.schedules.warmup_lr(warmup_max_lr=5e-05, "
        "warmup_min_lr=0, warmup_num_steps=0, warmup_type='log'), b1=0.9, b2=0.999, eps=1e-08, "
        "weight_decay=0.0)"
    )
    assert "unknown to this mapping" not in text  # the legacy key is known


def test_hf_zero3_template_with_trainer_arguments():
    t = translate(
        HF_ZERO3,
        auto={
            "learning_rate": 3e-4,
            "adam_beta2": 0.95,
            "warmup_steps": 100,
            "fp16": True,
            "world_size": 16,
            "hidden_size": 1024,
            "gradient_accumulation_steps": 4,
        },
    )
    resolved = {k: (v, source) for k, v, source in t.resolved}
    assert resolved["optimizer.params.betas"] == (
        [0.9, 0.95],
        "adam_beta1: HF Trainer default (TrainingArguments.adam_beta1 = 0.9); "
        "adam_beta2: given (TrainingArguments.adam_beta2)",
    )
    assert resolved["train_batch_size"][0] == 16 * 8 * 4
    assert resolved["zero_optimization.reduce_bucket_size"][0] == 1024 * 1024
    assert resolved["zero_optimization.stage3_prefetch_bucket_size"][0] == int(0.9 * 1024 * 1024)
    assert resolved["zero_optimization.stage3_param_persistence_threshold"][0] == 10 * 1024
    assert t.config.compute_dtype == "float16" and t.config.grad_accum_steps == 4
    schedule = schedules.warmup_lr(3e-4, warmup_min_lr=0, warmup_num_steps=100)
    assert_same_run(t.tx, optax.adamw(schedule, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.0), steps=3)


def test_hf_zero3_decay_template_needs_total_num_steps_and_says_how():
    with pytest.raises(ValueError) as caught:
        translate(HF_ZERO3_DECAY)
    text = str(caught.value)
    assert '1 "auto" value(s) have no default' in text
    assert "scheduler.params.total_num_steps: the HF Trainer computes it from the dataset" in text
    assert "auto={'scheduler.params.total_num_steps': ...}" in text
    assert "--set scheduler.params.total_num_steps=..." in text
    t = translate(HF_ZERO3_DECAY, auto={"scheduler.params.total_num_steps": 1000, "warmup_ratio": 0.1})
    resolved = {k: (v, source) for k, v, source in t.resolved}
    assert resolved["scheduler.params.total_num_steps"] == (1000, "given")
    assert resolved["scheduler.params.warmup_num_steps"] == (
        100,
        "HF Trainer: ceil(warmup_ratio 0.1 x total_num_steps 1000)",
    )
    assert "scheduler.params.total_num_steps = 1000: given" in t.message()
    resolved = {k: (v, source) for k, v, source in translate(HF_ZERO3_DECAY, auto={"max_steps": 500}).resolved}
    assert resolved["scheduler.params.total_num_steps"] == (500, "given (TrainingArguments.max_steps)")


def test_one_error_names_every_missing_value_and_every_bad_entry():
    """A config with "auto" never stops at the first one."""
    ds = {
        **HF_ZERO3_DECAY,
        "zero_optimization": {**HF_ZERO3["zero_optimization"], "stage": "auto"},
        "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto", "warmup_type": "auto"}},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    }
    with pytest.raises(ValueError) as caught:
        translate(
            ds,
            auto={
                "learning_rate": 3e-4,
                "scheduler.params.warmup_min_lr": 0.0,
                "lerning_rate": 1.0,
                "warmup_ratio": 0.1,
            },
        )
    text = str(caught.value)
    assert '3 "auto" value(s) have no default' in text
    for key in ("zero_optimization.stage", "scheduler.params.total_num_steps", "scheduler.params.warmup_type"):
        assert f"  {key}: " in text and f"--set {key}=..." in text
    assert "3 given value(s) do not apply" in text
    assert 'lerning_rate: neither an "auto" key of this config' in text
    assert "scheduler.params.warmup_min_lr: neither" in text  # not in this scheduler section
    assert "optimizer.params.lr: the config sets 0.001, the given learning_rate is 0.0003" in text
    with pytest.raises(ValueError, match=r"gradient_clipping: the config sets it to 1.0, not \"auto\""):
        translate({"gradient_clipping": 1.0}, auto={"gradient_clipping": 0.5})
    with pytest.raises(TypeError, match=r"auto takes a dict of values by key"):
        translate(HF_ZERO3, auto=[("learning_rate", 1e-3)])


def test_from_deepspeed_takes_auto_and_warns_with_the_sources():
    with pytest.warns(UserWarning, match=r"optimizer.params.lr = 0.0003: given \(TrainingArguments.learning_rate\)"):
        cfg = zj.from_deepspeed(HF_ZERO3, auto={"learning_rate": 3e-4, "fp16": True})
    assert cfg.compute_dtype == "float16" and cfg.loss_scaling.initial_scale_power == 16


# --- legacy keys ---------------------------------------------------------------------------


def test_legacy_zero_keys_are_known():
    zero = {
        "stage": 3,
        "stage3_gather_fp16_weights_on_model_save": True,
        "cpu_offload": True,
        "cpu_offload_param": True,
        "cpu_offload_use_pin_memory": True,
        "allgather_partitions": True,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "round_robin_gradients": True,
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "sub_group_size": 1e9,
        "elastic_checkpoint": False,
        "ignore_unused_parameters": True,
        "legacy_stage1": False,
        "memory_efficient_linear": True,
        "max_live_parameters": 1e9,
        "prefetch_bucket_size": 1e6,
    }
    t = translate({"gradient_clipping": 1.0, "zero_optimization": zero})
    assert "unknown to this mapping" not in t.message()
    assert t.config.offload.optimizer and t.config.offload.params  # cpu_offload, cpu_offload_param
    legacy = t.unmapped["zero_optimization.stage3_gather_fp16_weights_on_model_save"]
    assert "legacy name of stage3_gather_16bit" in legacy
    with pytest.raises(
        ValueError, match=r"'zero_optimization.cpu_offload_params' .* nearest one is 'cpu_offload_param'"
    ):
        translate({"gradient_clipping": 1.0, "zero_optimization": {"stage": 3, "cpu_offload_params": True}})
    for legacy, current in (
        ("cpu_offload", {"offload_optimizer": {"device": "cpu"}}),
        ("cpu_offload_param", {"offload_param": {"device": "cpu"}}),
        ("stage3_gather_fp16_weights_on_model_save", {"stage3_gather_16bit_weights_on_model_save": True}),
    ):
        with pytest.raises(ValueError, match=rf"both 'zero_optimization.{legacy}' \(the legacy name\)"):
            translate({"zero_optimization": {"stage": 3, legacy: True, **current}})


# --- command line --------------------------------------------------------------------------


def test_cli_set_fills_auto_values(tmp_path, capsys):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(HF_ZERO3_DECAY))
    assert cli.main(["from-deepspeed", str(path)]) == 2
    err = capsys.readouterr().err
    assert "scheduler.params.total_num_steps" in err and "--set scheduler.params.total_num_steps=..." in err
    assert (
        cli.main(
            [
                "from-deepspeed",
                str(path),
                "--set",
                "scheduler.params.total_num_steps=1000",
                "--set",
                "learning_rate=3e-4",
                "--set",
                "optimizer.params.betas=[0.9, 0.95]",
            ]
        )
        == 0
    )
    out = capsys.readouterr()
    assert "tx = optax.adamw(learning_rate=zj.optim.schedules.warmup_decay_lr(total_num_steps=1000, " in out.out
    assert "b1=0.9, b2=0.95" in out.out
    assert "scheduler.params.total_num_steps = 1000: given" in out.err
    assert "optimizer.params.lr = 0.0003: given (TrainingArguments.learning_rate)" in out.err
    with pytest.raises(SystemExit):
        cli.main(["from-deepspeed", str(path), "--set", "learning_rate"])
    assert "--set takes KEY=VALUE" in capsys.readouterr().err
    path.write_text(
        json.dumps(
            {
                "gradient_clipping": 1.0,
                "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-3, "warmup_type": "auto"}},
            }
        )
    )
    assert cli.main(["from-deepspeed", str(path), "--set", "scheduler.params.warmup_type=linear"]) == 0
    assert "schedule = zj.optim.schedules.warmup_lr(" in capsys.readouterr().out  # a string when not JSON
