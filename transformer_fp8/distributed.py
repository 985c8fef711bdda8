"""Transformer Engine's tensor-parallel RNG tracker (``transformer_engine.pytorch.distributed``).

CudaRNGStatesTracker keeps named random-generator states, each started from its own seed.
``with tracker.fork(name):`` swaps a named state into torch's default generators, runs the block
(attention dropout, for instance), keeps the state the block advanced to for the next fork of
that name, and puts the default generators back exactly as they were: code outside the forks
draws the same numbers whether or not the forked regions drew any.

Which generators: Transformer Engine's tracker drives the current CUDA device's default generator
only. Here each state holds the CPU default generator's state and, where CUDA is available, the
current CUDA device's default generator's state too, and a fork swaps both. So a forked region
draws from the tracked stream whether its tensors are on the CPU or on the GPU.

Tensor parallelism itself is not implemented by this library; the tracker serves models written
for Transformer Engine that pass ``get_rng_state_tracker`` (DotProductAttention,
MultiheadAttention, TransformerLayer and ``checkpoint`` use it: see their docstrings).
"""
from __future__ import annotations

import contextlib
from typing import Dict, Optional, Tuple

import torch

__all__ = ["CudaRNGStatesTracker", "check_rng_state_tracker", "DEFAULT_RNG_TRACKER_NAME"]

# The name Transformer Engine's fork() and modules use when none is given (Megatron-LM's too).
DEFAULT_RNG_TRACKER_NAME = "model-parallel-rng"

# One tracked state: (CPU generator state, CUDA generator state or None without CUDA).
State = Tuple[torch.Tensor, Optional[torch.Tensor]]


def _cuda_generator() -> Optional[torch.Generator]:
    if not torch.cuda.is_available():
        return None
    device = torch.cuda.current_device()  # (first: it initialises CUDA, which fills
    return torch.cuda.default_generators[device]  # default_generators)


def _current_state() -> State:
    cuda = _cuda_generator()
    return torch.default_generator.get_state(), (None if cuda is None else cuda.get_state())


def _install(state: State) -> None:
    cpu, cuda_state = state
    torch.default_generator.set_state(cpu)
    cuda = _cuda_generator()
    if cuda is not None and cuda_state is not None:
        cuda.set_state(cuda_state)


def _seeded_state(seed: int) -> State:
    """The state the default generators would have right after manual_seed(seed), made on
    fresh generators (the default ones are not touched)."""
    cpu = torch.Generator().manual_seed(seed).get_state()
    cuda = None
    if torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
        cuda = torch.Generator(device=device).manual_seed(seed).get_state()
    return cpu, cuda


class CudaRNGStatesTracker:
    """Named generator states for regions that must draw from their own stream.

    add(name, seed) starts a state; fork(name="model-parallel-rng") runs a block on it;
    get_states() / set_states(states) save and restore all of them (``checkpoint`` does, around
    a recomputation); reset() forgets every state and seed. A name or a seed can be added once
    (ValueError otherwise, until reset()); fork of a name never added is a ValueError.
    """

    def __init__(self):
        self.states_: Dict[str, State] = {}
        self.seeds_: set = set()

    def reset(self) -> None:
        """Forget every state and seed."""
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self) -> Dict[str, State]:
        """The current states, name -> state (a new dict; the states themselves are never
        modified in place, so it stays valid while forks go on)."""
        return dict(self.states_)

    def set_states(self, states: Dict[str, State]) -> None:
        """Replace the states with ``states`` (a dict from get_states; copied, so later forks
        leave the caller's dict as it was). Seeds are not checked, as in Transformer Engine."""
        if not isinstance(states, dict):
            raise TypeError("CudaRNGStatesTracker.set_states: states must be a dict from "
                            f"get_states(), got {type(states).__name__}")
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        """Start the state ``name`` from ``seed`` (as if the default generators had been
        seeded with it; their own states are left alone)."""
        if not isinstance(name, str):
            raise TypeError("CudaRNGStatesTracker.add: name must be a str, got "
                            f"{type(name).__name__}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError("CudaRNGStatesTracker.add: seed must be an int, got "
                            f"{type(seed).__name__}")
        # Both checked before anything is recorded (a refused add leaves the tracker as it was).
        if seed in self.seeds_:
            raise ValueError(f"CudaRNGStatesTracker.add: seed {seed} already exists")
        if name in self.states_:
            raise ValueError(f"CudaRNGStatesTracker.add: rng state {name!r} already exists")
        self.states_[name] = _seeded_state(seed)
        self.seeds_.add(seed)

    @contextlib.contextmanager
    def fork(self, name: str = DEFAULT_RNG_TRACKER_NAME):
        """Run the block on the state ``name``: it draws from that stream, which goes on where
        the block left it at the next fork; the default generators are restored on exit."""
        if name not in self.states_:
            raise ValueError(f"CudaRNGStatesTracker.fork: rng state {name!r} is not added "
                             f"(added: {sorted(self.states_)}); call add({name!r}, seed) first")
        outside = _current_state()
        _install(self.states_[name])
        try:
            yield
        finally:
            # A new state object (get_state() copies): dicts from get_states() keep the old one.
            self.states_[name] = _current_state()
            _install(outside)


def check_rng_state_tracker(owner: str, get_rng_state_tracker):
    """A module's ``get_rng_state_tracker``: None, or a callable returning a tracker with fork().
    Called once here (as Transformer Engine's modules call it at construction) to check it."""
    if get_rng_state_tracker is None:
        return None
    if not callable(get_rng_state_tracker):
        raise TypeError(f"{owner}: get_rng_state_tracker must be a callable that returns the "
                        "RNG tracker (e.g. a function returning a CudaRNGStatesTracker), got "
                        f"{type(get_rng_state_tracker).__name__}")
    tracker = get_rng_state_tracker()
    if not callable(getattr(tracker, "fork", None)):
        raise TypeError(f"{owner}: get_rng_state_tracker() must return a tracker with a fork() "
                        f"method (a CudaRNGStatesTracker), got {type(tracker).__name__}")
    return get_rng_state_tracker
