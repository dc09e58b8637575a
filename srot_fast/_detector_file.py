"""Detector files of :class:`srot_fast.OutlierDetector` (:meth:`~srot_fast.detector.OutlierDetector.save` /
:meth:`~srot_fast.detector.OutlierDetector.load`): the format, reading with ``torch.load(weights_only=True)``,
and the validation of every field before anything is built (malformed files raise :class:`DetectorFileError`).

A file is a dict: ``format`` / ``version``, ``config`` (the constructor's arguments), ``arch`` (the built-in
classifier's layout, or a user model's class), ``user_model``, ``state_dict`` (the classifier's tensors) and
``fitted`` (input shape, standardisation mean / std, eta, lr, omega, loss history, epochs).
"""
from __future__ import annotations

import math
import re

import torch
from torch import nn

from . import nets as _nets

_FORMAT = "srot_fast.OutlierDetector"
_FORMAT_VERSION = 2        # version 1 files (same layout, float32 statistics) load too
_MAX_LAYERS = 64           # detector files: at most this many hidden layers / convolutions
_MAX_WIDTH = 1 << 24       # detector files: at most this input dimension, width or channel count


class DetectorFileError(ValueError):
    """A file given to :meth:`OutlierDetector.load` is not a valid saved detector; the message says what is
    wrong (unreadable file, refused content, missing or malformed field, shapes that do not match)."""


def _arch_of(m: nn.Module) -> dict:
    """The architecture record of a classifier: built-in MLP / ConvNet layout, or a user model's class."""
    if isinstance(m, _nets.ConvNet):
        return {"kind": "convnet", "in_channels": m.in_channels, "widths": list(m.widths),
                "batch_norm": m.batch_norm}
    if isinstance(m, _nets.MLP):
        lins = [layer for layer in m.net if isinstance(layer, nn.Linear)]
        return {"kind": "mlp", "dim": lins[0].in_features, "hidden": [lin.out_features for lin in lins[:-1]]}
    return {"kind": "user", "class": f"{type(m).__module__}.{type(m).__qualname__}"}


_CONFIG_KEYS = ("hidden", "method", "eta", "xi", "omega", "epochs", "batch_size", "lr", "seed", "progress", "device",
                "num_threads", "power", "early_stopping")
_FITTED_KEYS = ("input_shape", "mean", "std", "eta", "lr", "history", "n_epochs")


def _read_detector_file(path, map_location):
    """torch.load(weights_only=True) with every failure but a missing / unreadable path as DetectorFileError."""
    import pickle

    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except (FileNotFoundError, IsADirectoryError, PermissionError):
        raise
    except pickle.UnpicklingError as exc:
        text = str(exc)
        found = re.search(r"(Unsupported global: [^\n]*?)(?:\. |\n|$)", text)
        if found:
            raise DetectorFileError(f"{path!s}: refused: it holds Python objects other than tensors and plain data, "
                                    f"which a detector file never does ({found.group(1)[:200]})") from None
        detail = " ".join(text.split("WeightsUnpickler error:")[-1].split())[:200]
        raise DetectorFileError(f"{path!s}: not a readable torch.save file (UnpicklingError: {detail})") from None
    except Exception as exc:     # truncated or foreign files surface as KeyError, EOFError, OSError, RuntimeError...
        detail = (str(exc).strip().splitlines() or [""])[0][:200]
        raise DetectorFileError(f"{path!s}: not a readable torch.save file ({type(exc).__name__}: {detail})") from None


def _int_in(value, lo: int, hi: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi


def _finite_number(value, minimum: float, allow_equal: bool) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return False
    return value >= minimum if allow_equal else value > minimum


def _int_list(value, name: str, path, max_len: int) -> list:
    if not isinstance(value, (list, tuple)) or len(value) > max_len or not all(
            _int_in(v, 1, _MAX_WIDTH) for v in value):
        raise DetectorFileError(f"{path!s}: {name} must be a list of at most {max_len} ints in [1, {_MAX_WIDTH}], "
                                f"got {value!r:.200}")
    return list(value)


def _arch_from_file(arch, path) -> dict:
    if not isinstance(arch, dict) or arch.get("kind") not in ("mlp", "convnet", "user"):
        raise DetectorFileError(f"{path!s}: 'arch' must be a dict with kind 'mlp', 'convnet' or 'user', got "
                                f"{arch!r:.200}")
    if arch["kind"] == "mlp":
        if not _int_in(arch.get("dim"), 1, _MAX_WIDTH):
            raise DetectorFileError(f"{path!s}: arch 'dim' must be an int in [1, {_MAX_WIDTH}], got "
                                    f"{arch.get('dim')!r:.200}")
        return {"kind": "mlp", "dim": arch["dim"], "hidden": _int_list(arch.get("hidden"), "arch 'hidden'", path,
                                                                       _MAX_LAYERS)}
    if arch["kind"] == "convnet":
        if not _int_in(arch.get("in_channels"), 1, _MAX_WIDTH) or not isinstance(arch.get("batch_norm"), bool):
            raise DetectorFileError(f"{path!s}: arch 'in_channels' must be an int in [1, {_MAX_WIDTH}] and "
                                    f"'batch_norm' a bool, got {arch.get('in_channels')!r:.100}, "
                                    f"{arch.get('batch_norm')!r:.100}")
        widths = _int_list(arch.get("widths"), "arch 'widths'", path, _MAX_LAYERS)
        if not widths:
            raise DetectorFileError(f"{path!s}: arch 'widths' is empty")
        return {"kind": "convnet", "in_channels": arch["in_channels"], "widths": widths,
                "batch_norm": arch["batch_norm"]}
    return {"kind": "user", "class": str(arch.get("class"))[:200]}


def _build_classifier(arch: dict) -> nn.Module:
    """The built-in classifier of a validated ``arch``, on the CPU (throwaway init, overwritten on load)."""
    gen = torch.Generator()
    if arch["kind"] == "mlp":
        return _nets.MLP(arch["dim"], arch["hidden"], generator=gen)
    return _nets.ConvNet(arch["in_channels"], arch["widths"], arch["batch_norm"], generator=gen)


def _expected_state(arch: dict) -> dict:
    """{name: (shape, floating)} of the state_dict of the built-in classifier ``arch``, computed without building
    it (the layer layout of :class:`srot_fast.nets.MLP` and :class:`srot_fast.nets.ConvNet`)."""
    out = {}
    if arch["kind"] == "mlp":
        sizes = [arch["dim"], *arch["hidden"], 1]
        for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
            out[f"net.{2 * i}.weight"] = ((fan_out, fan_in), True)
            out[f"net.{2 * i}.bias"] = ((fan_out,), True)
        return out
    c_in, j, bn = arch["in_channels"], 0, arch["batch_norm"]
    for c_out in arch["widths"]:
        out[f"features.{j}.weight"] = ((c_out, c_in, 3, 3), True)
        if not bn:
            out[f"features.{j}.bias"] = ((c_out,), True)
        else:
            for k in ("weight", "bias", "running_mean", "running_var"):
                out[f"features.{j + 1}.{k}"] = ((c_out,), True)
            out[f"features.{j + 1}.num_batches_tracked"] = ((), False)
        j += 3 if bn else 2
        c_in = c_out
    out["head.weight"] = ((1, c_in), True)
    out["head.bias"] = ((1,), True)
    return out


def _validate_detector_file(state, path, model_given: bool):
    """(config, arch, state_dict, fitted) of a loaded detector file, checked before anything is built."""
    if not isinstance(state, dict) or state.get("format") != _FORMAT:
        raise DetectorFileError(f"{path!s} is not a saved OutlierDetector (no 'format': {_FORMAT!r} entry)")
    if state.get("version") not in (1, _FORMAT_VERSION) or isinstance(state.get("version"), bool):
        raise DetectorFileError(f"{path!s}: unsupported OutlierDetector format version {state.get('version')!r:.100}"
                                f" (this version reads 1 and {_FORMAT_VERSION})")
    for key in ("config", "arch", "state_dict", "fitted"):
        if not isinstance(state.get(key), dict):
            raise DetectorFileError(f"{path!s}: missing or malformed {key!r} (a dict), got "
                                    f"{type(state.get(key)).__name__}")
    config = dict(state["config"])
    missing = [k for k in _CONFIG_KEYS if k not in config]
    extra = [k for k in config if k not in _CONFIG_KEYS]
    if missing or extra:
        raise DetectorFileError(f"{path!s}: 'config' has missing keys {missing} / unknown keys {extra!r:.200}")
    if not isinstance(config["hidden"], (list, tuple)):
        raise DetectorFileError(f"{path!s}: config 'hidden' must be a list of ints, got {config['hidden']!r:.200}")
    config["hidden"] = tuple(config["hidden"])
    if config["device"] is not None and not isinstance(config["device"], str):
        raise DetectorFileError(f"{path!s}: config 'device' must be None or a string, got {config['device']!r:.100}")
    if not isinstance(config["progress"], bool):
        raise DetectorFileError(f"{path!s}: config 'progress' must be a bool, got {config['progress']!r:.100}")

    arch = _arch_from_file(state["arch"], path)
    if arch["kind"] == "user" and not model_given:
        raise DetectorFileError(f"{path!s} holds a user model of class {arch['class']}: pass an instance of it, "
                                "OutlierDetector.load(path, model=...)")
    state_dict = state["state_dict"]
    for k, v in state_dict.items():
        if not isinstance(k, str) or not torch.is_tensor(v):
            raise DetectorFileError(f"{path!s}: 'state_dict' must map names to tensors, got {k!r:.100}: "
                                    f"{type(v).__name__}")
    if arch["kind"] != "user":
        expected = _expected_state(arch)
        if set(expected) != set(state_dict):
            raise DetectorFileError(
                f"{path!s}: 'state_dict' does not match arch {arch}: missing {sorted(set(expected) - set(state_dict))}"
                f", unexpected {sorted(set(state_dict) - set(expected))!r:.200}")
        for k, (shape, floating) in expected.items():
            got = state_dict[k]
            if tuple(got.shape) != shape or got.dtype.is_floating_point != floating:
                raise DetectorFileError(f"{path!s}: state_dict[{k!r}] has shape {tuple(got.shape)} and dtype "
                                        f"{got.dtype}, arch {arch} needs shape {shape} "
                                        f"({'floating' if floating else 'integer'})")

    fitted = dict(state["fitted"])
    missing = [k for k in _FITTED_KEYS if k not in fitted]
    if missing:
        raise DetectorFileError(f"{path!s}: 'fitted' has missing keys {missing}")
    shape = fitted["input_shape"]
    if not isinstance(shape, (list, tuple)) or len(shape) not in (1, 3) or not all(
            _int_in(v, 1, _MAX_WIDTH) for v in shape):
        raise DetectorFileError(f"{path!s}: fitted 'input_shape' must be [D] or [C, H, W] (ints in [1, "
                                f"{_MAX_WIDTH}]), got {shape!r:.200}")
    shape = [int(v) for v in shape]
    if arch["kind"] == "mlp" and shape != [arch["dim"]]:
        raise DetectorFileError(f"{path!s}: fitted 'input_shape' {shape} does not match the MLP's input dimension "
                                f"{arch['dim']}")
    if arch["kind"] == "convnet" and (len(shape) != 3 or shape[0] != arch["in_channels"]):
        raise DetectorFileError(f"{path!s}: fitted 'input_shape' {shape} does not match a ConvNet with "
                                f"{arch['in_channels']} input channels")
    stat_shape = (shape[0], 1, 1) if len(shape) == 3 else (shape[0],)
    for key in ("mean", "std"):
        t = fitted[key]
        if not torch.is_tensor(t) or not t.dtype.is_floating_point or tuple(t.shape) != stat_shape:
            raise DetectorFileError(
                f"{path!s}: fitted {key!r} must be a floating tensor of shape {stat_shape} (input shape {shape}), "
                f"got " + (f"shape {tuple(t.shape)}, {t.dtype}" if torch.is_tensor(t) else type(t).__name__))
        if not torch.isfinite(t).all() or (key == "std" and not (t > 0).all()):
            raise DetectorFileError(f"{path!s}: fitted {key!r} must be finite" + (" and > 0" if key == "std" else ""))
    if fitted["mean"].device != fitted["std"].device:
        raise DetectorFileError(f"{path!s}: fitted 'mean' and 'std' are on different devices")
    for key in ("eta", "lr"):
        if not _finite_number(fitted[key], 0.0, allow_equal=False):
            raise DetectorFileError(f"{path!s}: fitted {key!r} must be a finite number > 0, got {fitted[key]!r:.100}")
    omega = fitted.get("omega")
    if omega is not None and not _finite_number(omega, 0.0, allow_equal=True):
        raise DetectorFileError(f"{path!s}: fitted 'omega' must be None or a finite number >= 0, got {omega!r:.100}")
    history = fitted["history"]
    if not isinstance(history, (list, tuple)) or not all(
            isinstance(h, (int, float)) and not isinstance(h, bool) for h in history):
        raise DetectorFileError(f"{path!s}: fitted 'history' must be a list of numbers")
    if not _int_in(fitted["n_epochs"], 0, 1 << 40):
        raise DetectorFileError(f"{path!s}: fitted 'n_epochs' must be an int >= 0, got {fitted['n_epochs']!r:.100}")
    fitted = {"input_shape": shape, "mean": fitted["mean"], "std": fitted["std"], "eta": float(fitted["eta"]),
              "lr": float(fitted["lr"]), "omega": None if omega is None else float(omega),
              "history": [float(h) for h in history], "n_epochs": int(fitted["n_epochs"])}
    return config, arch, state_dict, fitted
