"""LAMB and AdamW over flat fp32 buffers: a fixed handful of kernel launches per step, whatever
the number of parameter tensors.

``FlatLamb`` is ``bertdist.train.lamb.Lamb`` (DeepSpeed FusedLamb's formula and defaults) and
``FlatAdamW`` is ``torch.optim.AdamW``, both with global-norm gradient clipping fused in:

    opt = FlatLamb(param_groups, lr=6e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01,
                   max_coeff=10.0, min_coeff=0.01, max_grad_norm=1.0)
    loss.backward(); opt.step(); opt.zero_grad()
    opt.grad_norm   # the pre-clip global gradient norm of the last step: a 0-d device tensor

At construction the optimizer copies every parameter into one flat fp32 buffer and makes each
parameter a view of its slice (``p.data``), and gives each a ``.grad`` that is a view of a flat
gradient buffer, so backward accumulates straight into it. Build it after the model is on its
device, and do not move the parameters afterwards (that would detach them from the buffer); a
wrapper that puts other tensors in the param groups (DeepSpeed's bf16 or ZeRO optimizers) is
refused at ``step``.
``zero_grad`` zeroes the gradient buffer in one fill and keeps the views. A ``.grad`` that is not
the view (``Module.zero_grad()`` set it to None and backward made a new one, or a framework
assigned one) is copied into the buffer at ``step``; a parameter with no gradient then counts as
a zero gradient (its moments still decay, as with ``zero_grad(set_to_none=False)``).

A step is ``flat_grad_norm`` (the global norm and the clip coefficient
``min(1, max_grad_norm / (norm + 1e-6))``, 2 launches on CUDA) and then, for each run of
consecutive param groups with the same hyper-parameters other than weight decay (usually one
run: weight decay is per tensor in the kernels), ``flat_lamb_step_`` (2 launches) or
``flat_adamw_step_`` (1 launch). The clip coefficient stays on the device; the step count and
lr are host numbers: a step never waits for the GPU. ``max_grad_norm <= 0`` disables clipping
(the norm is still computed).

The state is kept per parameter under the names and shapes of today's optimizers: ``exp_avg``,
``exp_avg_sq`` (views of the flat buffers) and ``step`` (a CPU float32 scalar, shared by the
parameters of a group), so ``state_dict()`` checkpoints look like ``Lamb``'s / AdamW's and load
either way; ``load_state_dict`` copies the moments back into the flat buffers (an exact resume).

``bf16_copy=True`` keeps a flat bf16 copy of the parameters (``flat_params_bf16``,
``bf16_params()``), written by the update kernels in the same pass: no extra launch.

``param_dtype=torch.bfloat16`` makes that copy the model's parameters: bf16 weights (so bf16
activations, with no cast per forward), fp32 master weights and fp32 gradient accumulation, as
Megatron-LM keeps them. Each parameter becomes a view of the flat bf16 buffer, which the update
kernels rewrite from the fp32 masters (``flat_params``, round to nearest even) in their own pass.
Backward leaves each micro-batch's bf16 gradient in ``.grad`` (views of a flat bf16 buffer);
``accumulate_grads()`` adds that buffer into the flat fp32 gradient buffer (``p.main_grad`` are
its views) and zeroes it: 2 launches per micro-batch whatever the number of tensors. Call it after
each micro-batch's backward (``step`` calls it for the last one): each micro-batch's gradient is
then rounded to bf16 once and the sum over the micro-batches is fp32. ``reduce_gradients(world)``
makes ``step`` all-reduce (mean) the fp32 sum over the default process group, in fp32, before the
norm. ``bind_module(model)`` makes ``model.state_dict()`` hold the fp32 masters (checkpoints and
exports carry fp32 weights, not their bf16 rounding) and ``model.load_state_dict()`` write them
(then the parameters are their rounding); write weights only that way, since a write into a bf16
parameter alone is overwritten from the masters at the next step.

``kernels`` picks the implementation as ``bertdist.ops.optim_dispatch`` says: ``auto`` (the
compiled kernels of the parameters' device, else the reference ops), ``fused``, ``reference``,
``emulated``. ``chunk_size`` is the kernels' reduction chunk (``flat_layout``); every
parameter must be fp32 and on one device.
"""
from __future__ import annotations

import torch
from torch.optim import Optimizer

from bertdist.ops.flat_layout import DEFAULT_CHUNK_SIZE, FlatLayout, flat_layout
from bertdist.ops.optim_dispatch import resolve_optim_ops


class _FlatOptimizer(Optimizer):
    """The flat buffers, gradient handling, state and clipping both optimizers share."""

    # the group keys that must agree for groups to share one kernel call (weight decay is per tensor)
    _run_keys: tuple[str, ...] = ()

    def __init__(self, params, defaults: dict, max_grad_norm: float, kernels: str, chunk_size: int,
                 bf16_copy: bool, param_dtype: torch.dtype = torch.float32):
        self._flat_ready = False
        super().__init__(params, defaults)
        self.max_grad_norm = float(max_grad_norm)
        self._params = [p for g in self.param_groups for p in g["params"]]
        if not self._params:
            raise ValueError("the optimizer got no parameters")
        devices = sorted({str(p.device) for p in self._params})
        if len(devices) != 1:
            raise ValueError(f"every parameter must be on one device, got {', '.join(devices)}")
        dtypes = sorted({str(p.dtype) for p in self._params if p.dtype != torch.float32})
        if dtypes:
            raise ValueError(f"the flat optimizer takes fp32 parameters; got {', '.join(dtypes)}")
        if param_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"param_dtype must be torch.float32 or torch.bfloat16, got {param_dtype}")
        self.param_dtype = param_dtype
        self.low_precision = param_dtype == torch.bfloat16
        self.device = self._params[0].device
        self._ops, self.kernel_source = resolve_optim_ops(kernels, self.device.type)
        self._layout = flat_layout([p.numel() for p in self._params], chunk_size)
        self._table = self._layout.table.to(self.device)
        n = self._layout.numel
        self._flat_params = torch.empty(n, dtype=torch.float32, device=self.device)
        self._flat_grads, self._exp_avg, self._exp_avg_sq = (torch.zeros_like(self._flat_params) for _ in range(3))
        self._spans = self._layout.spans()
        self._flat_params_bf16 = None
        # bf16 parameters: what backward writes (their .grad), folded into _flat_grads (fp32)
        self._flat_grads_lp = torch.zeros(n, dtype=param_dtype, device=self.device) if self.low_precision else None
        self._grad_views = []
        self._masters: dict[int, torch.Tensor] = {}  # id(parameter) -> its fp32 master (a view)
        self._reduce_world = 1
        with torch.no_grad():
            for p, (a, b) in zip(self._params, self._spans):
                self._flat_params[a:b].copy_(p.detach().reshape(-1))
            if bf16_copy or self.low_precision:
                self._flat_params_bf16 = self._flat_params.to(torch.bfloat16)
            model_params = self._flat_params_bf16 if self.low_precision else self._flat_params
            model_grads = self._flat_grads_lp if self.low_precision else self._flat_grads
            for p, (a, b) in zip(self._params, self._spans):
                grad = p.grad
                p.grad = None  # a grad of the old dtype cannot stay on a parameter of the new one
                p.data = model_params[a:b].view(p.shape)
                view = model_grads[a:b].view(p.shape)
                if grad is not None:
                    view.copy_(grad)
                p.grad = view
                self._grad_views.append(view)
                self._masters[id(p)] = self._flat_params[a:b].view(p.shape)
                if self.low_precision:
                    p.main_grad = self._flat_grads[a:b].view(p.shape)
        # group i owns segments _group_bounds[i] .. _group_bounds[i + 1]
        self._group_bounds = [0]
        for g in self.param_groups:
            self._group_bounds.append(self._group_bounds[-1] + len(g["params"]))
        self._steps = [0] * len(self.param_groups)
        self._step_tensors = [torch.zeros((), dtype=torch.float32) for _ in self.param_groups]
        self._bind_state()
        self._stats: torch.Tensor | None = None
        self._runs_cache: dict = {}
        self._flat_ready = True

    # ------------------------------------------------------------ the flat buffers and the state

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_flat_ready", False):
            raise RuntimeError("the flat optimizer's buffers are fixed at construction: pass every param group then")
        super().add_param_group(param_group)

    def _bind_state(self) -> None:
        """Points each parameter's state at its slices of the flat buffers and its group's step."""
        for gi, group in enumerate(self.param_groups):
            first = self._group_bounds[gi]
            for k, p in enumerate(group["params"]):
                a, b = self._spans[first + k]
                self.state[p] = {"step": self._step_tensors[gi], "exp_avg": self._exp_avg[a:b].view(p.shape),
                                 "exp_avg_sq": self._exp_avg_sq[a:b].view(p.shape)}

    def load_state_dict(self, state_dict: dict) -> None:
        # The saved tensors themselves: torch's loading casts a state's floating tensors to its
        # parameter's dtype, which would round fp32 moments to bf16 for bf16 parameters.
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        saved = [state_dict["state"].get(i, {}) for i in saved_ids]
        super().load_state_dict(state_dict)
        with torch.no_grad():
            for gi, group in enumerate(self.param_groups):
                first, steps = self._group_bounds[gi], []
                for k, p in enumerate(group["params"]):
                    a, b = self._spans[first + k]
                    st = saved[first + k]
                    for name, flat in (("exp_avg", self._exp_avg), ("exp_avg_sq", self._exp_avg_sq)):
                        if name in st:
                            flat[a:b].copy_(st[name].reshape(-1))
                        else:
                            flat[a:b].zero_()
                    steps.append(int(st["step"].item()) if "step" in st else 0)
                if len(set(steps)) > 1:
                    raise ValueError(f"param group {gi}: the flat optimizer steps a group's parameters together, but "
                                     f"the state dict has per-parameter step counts {sorted(set(steps))}")
                self._steps[gi] = steps[0] if steps else 0
                self._step_tensors[gi] = torch.tensor(float(self._steps[gi]), dtype=torch.float32)
        self._bind_state()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zeroes the flat gradient buffer(s), one fill each; the ``.grad`` views stay (``set_to_none``
        is ignored: a None gradient would make backward allocate a tensor outside the buffer)."""
        self._flat_grads.zero_()
        if self._flat_grads_lp is not None:
            self._flat_grads_lp.zero_()
        for p, view in zip(self._params, self._grad_views):
            if p.grad is not view:
                p.grad = view

    @torch.no_grad()
    def accumulate_grads(self) -> None:
        """bf16 parameters: adds the bf16 gradients of the last backward into the fp32 sum and zeroes
        them (2 launches); fp32 parameters: nothing to do (their ``.grad`` is the fp32 sum) but bring
        stray gradients into the buffer."""
        self._gather_grads()
        if self._flat_grads_lp is not None:
            self._flat_grads.add_(self._flat_grads_lp)
            self._flat_grads_lp.zero_()

    def reduce_gradients(self, world_size: int) -> None:
        """Makes ``step`` average the fp32 gradient sums of ``world_size`` ranks (one all-reduce over
        the default process group, in fp32) before the norm; 1: no reduction. For bf16 parameters,
        whose fp32 sums no data-parallel wrapper sees."""
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self._reduce_world = int(world_size)

    def bind_module(self, module: torch.nn.Module) -> None:
        """``module.state_dict()`` holds the fp32 masters in place of the parameters, and
        ``module.load_state_dict()`` writes the masters as well as the parameters (the parameters
        are then the masters' rounding): checkpoints and exports carry the fp32 weights, and a
        resume or a new phase continues from them exactly. A no-op for fp32 parameters (they are
        the masters)."""
        if not self.low_precision:
            return
        # plain functions: torch marks the hooks it is given with an attribute, which a bound method refuses
        module.register_state_dict_post_hook(lambda *args: self._masters_into_state_dict(*args))
        module.register_load_state_dict_pre_hook(lambda *args: self._state_dict_into_masters(*args))

    def _named_masters(self, module: torch.nn.Module, prefix: str):
        for name, p in module.named_parameters(remove_duplicate=False):
            master = self._masters.get(id(p))
            if master is not None:
                yield prefix + name, master

    def _masters_into_state_dict(self, module, state_dict, prefix, local_metadata) -> None:
        for key, master in self._named_masters(module, prefix):
            if key in state_dict:
                state_dict[key] = master.detach()

    @torch.no_grad()
    def _state_dict_into_masters(self, module, state_dict, prefix, *args) -> None:
        for key, master in self._named_masters(module, prefix):
            value = state_dict.get(key)
            if isinstance(value, torch.Tensor) and value.shape == master.shape:  # else load_state_dict says why
                master.copy_(value)

    def _gather_grads(self) -> None:
        """Brings every gradient into the flat buffer (a no-op for the views backward filled)."""
        current = [p for g in self.param_groups for p in g["params"]]
        if len(current) != len(self._params) or any(a is not b for a, b in zip(current, self._params)):
            raise RuntimeError(f"the param groups hold other tensors than the {len(self._params)} the flat buffers were "
                               f"built for (now {len(current)}): a wrapper (DeepSpeed's bf16 or ZeRO optimizer) "
                               "replaced them; give it the flat optimizer's parameters or use another optimizer")
        for p, view in zip(self._params, self._grad_views):
            g = p.grad
            if g is view:
                continue
            if g is None:
                view.zero_()
            elif g.data_ptr() != view.data_ptr():
                if g.is_sparse:
                    raise RuntimeError("the flat optimizer does not support sparse gradients")
                view.copy_(g)
            p.grad = view

    @property
    def grad_norm(self) -> torch.Tensor | None:
        """The global gradient norm (before clipping) of the last step, a 0-d fp32 device tensor."""
        return None if self._stats is None else self._stats[0]

    @property
    def flat_params(self) -> torch.Tensor:
        """The fp32 master weights: the buffer every parameter is a view of (fp32 parameters), or
        the buffer the bf16 parameters are rounded from."""
        return self._flat_params

    @property
    def flat_grads(self) -> torch.Tensor:
        """The fp32 gradient sum the step reads (bf16 parameters: after ``accumulate_grads``)."""
        return self._flat_grads

    def master_params(self) -> list[torch.Tensor]:
        """The fp32 master of each parameter (views of ``flat_params``), in param-group order."""
        return [self._masters[id(p)] for p in self._params]

    @property
    def flat_params_bf16(self) -> torch.Tensor | None:
        """With ``bf16_copy``: the parameters rounded to bf16 (round to nearest even), taken at
        construction and rewritten by every step in the update's own pass (weights loaded into the
        model in between reach it at the next step); else None."""
        return self._flat_params_bf16

    def bf16_params(self) -> list[torch.Tensor]:
        """Views of ``flat_params_bf16`` shaped like the parameters, in param-group order."""
        if self._flat_params_bf16 is None:
            raise RuntimeError("this optimizer keeps no bf16 copy: construct it with bf16_copy=True")
        return [self._flat_params_bf16[a:b].view(p.shape) for p, (a, b) in zip(self._params, self._spans)]

    def _all_reduce_grads(self) -> None:
        import torch.distributed as dist

        dist.all_reduce(self._flat_grads)
        self._flat_grads.div_(self._reduce_world)

    @property
    def layout(self) -> FlatLayout:
        return self._layout

    # ------------------------------------------------------------ the step

    def _runs(self) -> list[tuple[int, int]]:
        """Runs (first group, end group) of consecutive groups whose run keys and steps agree."""
        runs, start = [], 0
        key = lambda i: (tuple(self.param_groups[i][k] for k in self._run_keys), self._steps[i])  # noqa: E731
        for i in range(1, len(self.param_groups) + 1):
            if i == len(self.param_groups) or key(i) != key(start):
                runs.append((start, i))
                start = i
        return runs

    def _run_buffers(self, g0: int, g1: int):
        """(layout, device table, weight-decay tensor, element span) of groups g0 .. g1 - 1, cached."""
        s0, s1 = self._group_bounds[g0], self._group_bounds[g1]
        wd = tuple(float(self.param_groups[gi]["weight_decay"]) for gi in range(g0, g1)
                   for _ in self.param_groups[gi]["params"])
        cached = self._runs_cache.get((g0, g1))
        if cached is None or cached[0] != wd:
            layout = self._layout if (s0, s1) == (0, len(self._params)) else self._layout.sub(s0, s1)
            table = self._table if layout is self._layout else layout.table.to(self.device)
            wd_t = torch.tensor(wd, dtype=torch.float32).to(self.device)
            cached = (wd, layout, table, wd_t)
            self._runs_cache[(g0, g1)] = cached
        a = self._spans[s0][0] if s0 < len(self._spans) else self._layout.numel
        return cached[1], cached[2], cached[3], (a, a + cached[1].numel)

    @torch.no_grad()
    def step(self, closure=None):
        with torch.enable_grad():
            loss = closure() if closure is not None else None
        self.accumulate_grads()
        if self._reduce_world > 1:
            self._all_reduce_grads()
        L = self._layout
        _, self._stats = self._ops.grad_norm(self._flat_grads, self._table, L.num_chunks, L.chunk_size,
                                             self.max_grad_norm)
        for gi in range(len(self.param_groups)):
            self._steps[gi] += 1
            self._step_tensors[gi].fill_(float(self._steps[gi]))
        for g0, g1 in self._runs():
            layout, table, wd, (a, b) = self._run_buffers(g0, g1)
            if layout.numel == 0:
                continue
            bufs = (self._flat_params[a:b], self._flat_grads[a:b], self._exp_avg[a:b], self._exp_avg_sq[a:b])
            bf16 = None if self._flat_params_bf16 is None else self._flat_params_bf16[a:b]
            self._update(self.param_groups[g0], self._steps[g0], bufs, table, layout, wd, bf16)
        return loss

    def _update(self, group: dict, step: int, bufs, table, layout: FlatLayout, wd: torch.Tensor,
                bf16: torch.Tensor | None) -> None:
        raise NotImplementedError


def _check_common(lr: float, betas, eps: float, max_grad_norm: float) -> None:
    if lr < 0.0:
        raise ValueError(f"invalid learning rate {lr}")
    if not 0.0 <= betas[0] < 1.0 or not 0.0 <= betas[1] < 1.0:
        raise ValueError(f"invalid betas {tuple(betas)}: each must be in [0, 1)")
    if eps < 0.0:
        raise ValueError(f"invalid eps {eps}")
    if max_grad_norm != max_grad_norm:  # NaN
        raise ValueError(f"invalid max_grad_norm {max_grad_norm}")


class FlatLamb(_FlatOptimizer):
    """``bertdist.train.lamb.Lamb`` over flat buffers, with fused global-norm clipping."""

    _run_keys = ("lr", "betas", "eps", "bias_correction", "max_coeff", "min_coeff")

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-6, weight_decay: float = 0.01,
                 max_coeff: float = 10.0, min_coeff: float = 0.01, max_grad_norm: float = 0.0, *,
                 bias_correction: bool = True, kernels: str = "auto", chunk_size: int = DEFAULT_CHUNK_SIZE,
                 bf16_copy: bool = False, param_dtype: torch.dtype = torch.float32):
        _check_common(lr, betas, eps, max_grad_norm)
        if not 0.0 <= min_coeff <= max_coeff:
            raise ValueError(f"need 0 <= min_coeff <= max_coeff, got min_coeff {min_coeff}, max_coeff {max_coeff}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, max_coeff=max_coeff, min_coeff=min_coeff)
        super().__init__(params, defaults, max_grad_norm, kernels, chunk_size, bf16_copy, param_dtype)

    def _update(self, group, step, bufs, table, layout, wd, bf16):
        b1, b2 = group["betas"]
        self._ops.lamb_step_(*bufs, table, layout.num_chunks, layout.chunk_size, wd, self._stats, step=step,
                             lr=group["lr"], beta1=b1, beta2=b2, eps=group["eps"],
                             bias_correction=group["bias_correction"], max_coeff=group["max_coeff"],
                             min_coeff=group["min_coeff"], params_bf16=bf16)


class FlatAdamW(_FlatOptimizer):
    """``torch.optim.AdamW`` (decoupled weight decay, bias correction) over flat buffers, with fused
    global-norm clipping."""

    _run_keys = ("lr", "betas", "eps")

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01,
                 max_grad_norm: float = 0.0, *, kernels: str = "auto", chunk_size: int = DEFAULT_CHUNK_SIZE,
                 bf16_copy: bool = False, param_dtype: torch.dtype = torch.float32):
        _check_common(lr, betas, eps, max_grad_norm)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults, max_grad_norm, kernels, chunk_size, bf16_copy, param_dtype)

    def _update(self, group, step, bufs, table, layout, wd, bf16):
        b1, b2 = group["betas"]
        self._ops.adamw_step_(*bufs, table, layout.num_chunks, layout.chunk_size, wd, self._stats, step=step,
                              lr=group["lr"], beta1=b1, beta2=b2, eps=group["eps"], params_bf16=bf16)
