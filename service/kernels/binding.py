"""The ctypes binding, generated from ``src/kvkernels.h`` (the one header every source
includes): its ``#define`` constants, its structs as ``ctypes.Structure`` classes and
its functions' argument types. Nothing here is written twice: a function or field added
to the header is bound by the next load, and ``Library`` refuses a library whose struct
sizes differ from the header's (``kv_struct_size``). Standard library only (torch-free).
"""

from __future__ import annotations

import ctypes
import re
from functools import lru_cache
from pathlib import Path

HEADER = Path(__file__).resolve().parent / "src" / "kvkernels.h"

_SCALARS = {"int64_t": ctypes.c_int64, "int": ctypes.c_int, "float": ctypes.c_float}


class Binding:
    """What the header declares: ``constants`` (name -> int), ``structs`` (name ->
    ctypes.Structure subclass, in declaration order) and ``functions`` (name ->
    (argtypes, restype))."""

    def __init__(self, text: str) -> None:
        text = re.sub(r"//[^\n]*", "", text)
        self.constants = {m[1]: int(m[2]) for m in re.finditer(r"^#define\s+(KV_\w+)\s+(-?\d+)\s*$", text, re.M)}
        self.structs: dict[str, type[ctypes.Structure]] = {}
        for name, body in re.findall(r"struct\s+(\w+)\s*\{(.*?)\};", text, re.S):
            fields = []
            for decl in filter(None, (d.strip() for d in body.split(";"))):
                ctype, field = decl.rsplit(None, 1)
                fields.append((field.lstrip("*"), self._type(ctype + ("*" if field.startswith("*") else ""))))
            self.structs[name] = type(name, (ctypes.Structure,), {"_fields_": fields})
        body = re.sub(r"struct\s+\w+\s*\{.*?\};", "", text, flags=re.S)
        self.functions: dict[str, tuple[list, object]] = {}
        for ret, name, args in re.findall(r"^\s*([\w\s\*]+?)\s*\b(kv_\w+)\s*\(([^)]*)\)\s*;", body, re.M | re.S):
            params = [a.strip() for a in args.split(",") if a.strip() and a.strip() != "void"]
            argtypes = [self._type(p.rsplit(None, 1)[0] + ("*" if p.rsplit(None, 1)[1].startswith("*") else ""))
                        for p in params]  # fmt: skip
            self.functions[name] = (argtypes, None if ret.strip() == "void" else self._type(ret))

    def _type(self, ctype: str):
        ctype = ctype.replace("const ", "").strip()
        if ctype.endswith("*"):
            return ctypes.c_char_p if ctype == "char*" else ctypes.c_void_p
        if ctype in _SCALARS:
            return _SCALARS[ctype]
        if ctype in self.structs:
            return self.structs[ctype]
        raise ValueError(f"kvkernels.h: type {ctype!r} is not one binding.py knows")

    def declare(self, lib: ctypes.CDLL) -> None:
        """Set every declared function's argtypes and restype on ``lib``; ValueError when
        the library lacks one or its structs' sizes differ from the header's."""
        for name, (argtypes, restype) in self.functions.items():
            try:
                fn = getattr(lib, name)
            except AttributeError:
                raise ValueError(f"the library has no {name} (declared in kvkernels.h)") from None
            fn.argtypes, fn.restype = argtypes, restype
        for which, (name, struct) in enumerate(self.structs.items()):
            size = lib.kv_struct_size(which)
            if size != ctypes.sizeof(struct):
                raise ValueError(f"struct {name}: {size} bytes in the library, {ctypes.sizeof(struct)} in kvkernels.h")


@lru_cache(maxsize=None)
def header_binding(header: Path = HEADER) -> Binding:
    return Binding(header.read_text())
