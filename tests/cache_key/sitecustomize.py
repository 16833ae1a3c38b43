"""Test-only (tests/conftest.py puts this folder on PYTHONPATH): one persistent-cache key for a CPU program
whichever process of a multi-process job compiles it.

jax keys a cached program by its devices' topology fingerprint, and on CPU the topology jax builds holds only
the calling process's own devices, with its process index: process 1 of a pair never finds what process 0
wrote (and only process 0 writes), so every 2-process test and every launch restart compiled process 1's
programs again. Here the CPU key hashes the program's devices (id, process, kind) and the topology's machine
attributes (the target CPU and its features) without the per-process device list. The patch is applied when
jax imports its cache-key module, so a subprocess that never imports jax pays nothing."""
import importlib.abc
import importlib.util
import os
import sys

_MODULE = "jax._src.cache_key"


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    out = shift = 0
    while True:
        b = buf[i]
        out |= (b & 0x7F) << shift
        i, shift = i + 1, shift + 7
        if b < 0x80:
            return out, i


def _fields(buf: bytes):
    """(field number, raw bytes of the whole field, payload if length-delimited) of a protobuf message."""
    i = 0
    while i < len(buf):
        start = i
        tag, i = _varint(buf, i)
        kind, payload = tag & 7, None
        if kind == 0:
            _, i = _varint(buf, i)
        elif kind == 1:
            i += 8
        elif kind == 5:
            i += 4
        elif kind == 2:
            n, i = _varint(buf, i)
            payload, i = buf[i:i + n], i + n
        else:
            raise ValueError(f"wire type {kind}")
        yield tag >> 3, buf[start:i], payload


def _machine(topology: bytes) -> bytes:
    """The serialized topology less CpuTopologyProto's device list (field 1 of the packed Any's value)."""
    out = []
    for num, raw, payload in _fields(topology):
        if payload is not None and b"CpuTopologyProto" in payload:
            for any_num, any_raw, value in _fields(payload):
                if any_num == 2 and value is not None:
                    out += [raw for n, raw, _ in _fields(value) if n != 1]
                else:
                    out.append(any_raw)
        else:
            out.append(raw)
    return b"".join(out)


def _patch(ck) -> None:
    original = ck._hash_accelerator_config

    def _hash_accelerator_config(hash_obj, accelerators):
        devices = list(accelerators.flat)
        if not devices or devices[0].platform != "cpu":
            return original(hash_obj, accelerators)
        try:
            local = [d for d in devices if d.process_index == devices[0].client.process_index()]
            machine = _machine(ck.xla_client.get_topology_for_devices(local).serialize())
        except Exception:
            return original(hash_obj, accelerators)
        hash_obj.update(machine)
        for d in devices:
            ck._hash_string(hash_obj, f"{d.id}:{d.process_index}:{d.device_kind}")

    ck._hash_accelerator_config = _hash_accelerator_config


def _patch_compiler(compiler) -> None:
    """With jax_share_binary_between_hosts, the process holding a job's first device compiles a program that
    spans processes and hands it to the others through the coordinator; but where it loads the program from
    the persistent cache it hands nothing, and a process that missed the cache would wait for ever. Here it
    hands over what it loaded too (once per program)."""
    read, shared = compiler._cache_read, set()
    # on here, with the keys above (not in the environment, which children without this hook would inherit):
    # a process whose key differs from process 0's would wait for ever for its program
    if "JAX_SHARE_BINARY_BETWEEN_HOSTS" not in os.environ:
        compiler.config.config.update("jax_share_binary_between_hosts", True)

    def _cache_read(module_name, cache_key, compile_options, backend, executable_devices, host_callbacks):
        executable, compile_time = read(module_name, cache_key, compile_options, backend, executable_devices,
                                        host_callbacks)
        state, devices = compiler.distributed.global_state, list(executable_devices)
        if (executable is not None and compiler.config.share_binary_between_hosts.value
                and state.client is not None and len({d.process_index for d in devices}) > 1
                and min(devices, key=lambda d: d.id).process_index == state.process_id
                and cache_key not in shared
                and cache_key not in compiler._compile_and_share_module.modules_cache):
            shared.add(cache_key)  # the cached bytes: a loaded program serialized again lacks its object code
            cache = compiler.compilation_cache
            stored = cache.decompress_executable(cache._get_cache(backend).get(cache_key))
            state.client.key_value_set_bytes(cache_key, cache.compress_executable(
                cache.extract_executable_and_time(stored)[0]))
        return executable, compile_time

    compiler._cache_read = _cache_read


_PATCHES = {_MODULE: _patch, "jax._src.compiler": _patch_compiler}


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name not in _PATCHES or name in _done:
            return None
        _done.add(name)
        if len(_done) == len(_PATCHES):
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run, patch = spec.loader.exec_module, _PATCHES[name]

        def exec_module(module):
            run(module)
            patch(module)

        spec.loader.exec_module = exec_module
        return spec


_done: set[str] = set()
sys.meta_path.insert(0, _PatchOnImport())
