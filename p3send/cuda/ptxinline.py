"""Textual inlining of a PTX device function into its call sites, for the modules that are
compiled relocatably (nvJitLink: the NVSHMEM transport's modules). The driver's whole-program JIT
inlines p3_send_rows into its caller; a relocatable compile keeps it a real call, whose register
saves and ABI cost doubled the send's time (docs/SCALING.md section 5.5). ``inline_calls`` does
what the whole-program JIT does, in the text: each ``call`` of the function becomes a block with
the function's body, its registers and labels renamed per site, its ``ld.param`` of a parameter
a ``mov`` from the value the call site stored, its ``ret`` a branch to the block's end.

Only for p3send's own hand-written PTX (one function definition, call sites in the shape
``{ .param decls; st.param ...; call.uni f, (args); }``); anything else is refused by name.
"""
from __future__ import annotations

import re

from ..abi.errors import ConfigError

#: PTX special registers: never renamed.
_SPECIAL = {"laneid", "warpid", "nwarpid", "smid", "nsmid", "gridid", "tid", "ntid", "ctaid", "nctaid",
            "clock", "clock64", "globaltimer", "globaltimer_lo", "globaltimer_hi", "dynamic_smem_size",
            "total_smem_size", "lanemask_eq", "lanemask_le", "lanemask_lt", "lanemask_ge", "lanemask_gt",
            "pm0", "pm1", "pm2", "pm3", "envreg", "aggr_smem_size", "reserved_smem_offset_begin",
            "reserved_smem_offset_end", "reserved_smem_offset_cap", "reserved_smem_offset_2",
            "clusterid", "nclusterid", "cluster_ctaid", "cluster_nctaid", "cluster_ctarank", "cluster_nctarank",
            "is_explicit_cluster", "current_graph_exec"}
_REG = re.compile(r"%([A-Za-z_$][\w$]*)")
_LABEL_DEF = re.compile(r"^\s*([A-Za-z_$][\w$]*):", re.M)


def _strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return "\n".join(line.split("//")[0].rstrip() for line in text.split("\n"))


def _matching_brace(text: str, at: int) -> int:
    depth = 0
    for i in range(at, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return i
    raise ConfigError(["unbalanced braces"], "PTX inline")


def _definition(code: str, name: str):
    """(start, end, parameter names, body) of ``.func name(...) { body }`` in comment-free code."""
    m = re.search(rf"(?:\.visible\s+|\.weak\s+)?\.func\s+{re.escape(name)}\s*\(([^)]*)\)\s*\{{", code)
    if m is None:
        raise ConfigError([f"no definition of .func {name}"], "PTX inline")
    params = re.findall(r"\.param\s+\.\w+\s+([A-Za-z_$][\w$]*)", m.group(1))
    open_at = m.end() - 1
    close_at = _matching_brace(code, open_at)
    return m.start(), close_at + 1, params, code[open_at + 1:close_at]


def _renamed_body(body: str, params: list[str], args: dict[str, str], tag: str) -> str:
    labels = set(_LABEL_DEF.findall(body))

    def reg(m):
        n = m.group(1)
        return m.group(0) if n in _SPECIAL else f"%{tag}_{n}"
    out = []
    end = f"{tag}_END"
    for line in body.split("\n"):
        s = line.strip()
        if not s:
            continue
        pm = re.match(r"ld\.param\.(\w+)\s+(%[\w$]+)\s*,\s*\[\s*([A-Za-z_$][\w$]*)\s*\]\s*;$", s)
        if pm and pm.group(3) in params:
            typ, dst, p = pm.groups()
            out.append(f"    mov.{typ} {_REG.sub(reg, dst)}, {args[p]};")
            continue
        if re.fullmatch(r"(@!?%[\w$]+\s+)?ret(\.uni)?\s*;", s):
            guard = re.match(r"(@!?%[\w$]+)\s+", s)
            # a guarded ret may diverge: bra.uni only where every lane takes it
            out.append(f"    {_REG.sub(reg, guard.group(1)) + ' bra' if guard else 'bra.uni'} {end};")
            continue
        line = _REG.sub(reg, line)
        for lab in labels:
            line = re.sub(rf"(?<![\w$%]){re.escape(lab)}(?![\w$])", f"{tag}_{lab}", line)
        out.append(line)
    out.append(f"{end}:")
    return "\n".join(out)


def inline_calls(text: str, name: str) -> tuple[str, int]:
    """``text`` (a whole module) with every ``call`` of ``.func name`` replaced by the function's
    body; the definition stays (unused) so that the module's declarations do not change.

    Returns:
        (the text, comments dropped but for its leading header block; the number of call sites
        inlined).

    Raises:
        ConfigError: no definition, or a call site of another shape.
    """
    code = _strip_comments(text)
    _, _, params, body = _definition(code, name)
    call = re.compile(rf"\{{([^{{}}]*?)call(?:\.uni)?\s+{re.escape(name)}\s*,\s*\(([^)]*)\)\s*;\s*\}}", re.S)
    n = 0

    def site(m):
        nonlocal n
        tag = f"I{n}_{name}"
        n += 1
        pre, argnames = m.group(1), [a.strip() for a in m.group(2).split(",")]
        if len(argnames) != len(params):
            raise ConfigError([f"a call of {name} with {len(argnames)} arguments, {len(params)} declared"],
                              "PTX inline")
        decl = {v: k for k, v in re.findall(r"\.param\s+\.(\w+)\s+([A-Za-z_$][\w$]*)\s*;", pre)}
        lines = [f"    .reg .{decl[a]} %{tag}_arg_{a};" for a in argnames if a in decl]
        for line in pre.split("\n"):
            s = line.strip()
            if not s or s.startswith(".param"):
                continue
            sm = re.match(r"st\.param\.(\w+)\s*\[\s*([A-Za-z_$][\w$]*)\s*\]\s*,\s*(.+);$", s)
            if sm:
                lines.append(f"    mov.{sm.group(1)} %{tag}_arg_{sm.group(2)}, {sm.group(3).strip()};")
            elif s.startswith(("st.param", "ld.param")):
                raise ConfigError([f"a call of {name}: {s!r} is not in the shape this inliner handles "
                                   "(st.param [name], value)"], "PTX inline")
            else:
                lines.append(line)
        args = {p: f"%{tag}_arg_{a}" for p, a in zip(params, argnames)}
        missing = [a for a in argnames if a not in decl]
        if missing:
            raise ConfigError([f"a call of {name} passes undeclared parameters {missing}"], "PTX inline")
        return "{\n" + "\n".join(lines) + "\n" + _renamed_body(body, params, args, tag) + "\n}"

    # the functions the body calls, declared before any site (the inlined body lands in entries
    # that come before their definitions in the module)
    protos = []
    for callee in sorted(set(re.findall(r"call(?:\.uni)?\s+([A-Za-z_$][\w$]*)", body))):
        dm = re.search(rf"(\.weak|\.extern|\.visible)?\s*\.func\s+{re.escape(callee)}\s*\(([^)]*)\)", code)
        if dm is None:
            raise ConfigError([f"{name} calls {callee}, which the module does not declare"], "PTX inline")
        link = dm.group(1) or ""
        protos.append(f"{link + ' ' if link else ''}.func {callee}({' '.join(dm.group(2).split())});")
    if protos:
        am = re.search(r"^\s*\.address_size\s+\d+\s*$", code, re.M)
        if am is None:
            raise ConfigError(["no .address_size directive to declare the callees after"], "PTX inline")
        code = code[:am.end()] + "\n" + "\n".join(protos) + code[am.end():]
    d0, _, _, _ = _definition(code, name)
    head, tail = code[:d0], code[d0:]
    # call sites before the definition (the entry, then the appended functions) and after it
    head = call.sub(site, head)
    _, e, _, _ = _definition(tail, name)
    tail = tail[:e] + call.sub(site, tail[e:])
    # the text's leading comment block (an entry's header: the loader checks parameters against it)
    lines = text.split("\n")
    k = 0
    while k < len(lines) and (not lines[k].strip() or lines[k].lstrip().startswith("//")):
        k += 1
    out = "\n".join(lines[:k]) + "\n" + head + tail
    left = len(re.findall(rf"call(?:\.uni)?\s+(?:\([^)]*\)\s*,\s*)?{re.escape(name)}\s*,", out))
    if left:
        raise ConfigError([f"{left} call(s) of {name} not in the shape this inliner handles (a block of .param "
                           "declarations, st.param [name] stores and the call)"], "PTX inline")
    return out, n
