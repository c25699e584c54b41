"""Add mode's cost per verify pass, with and without overlap, against the all-local verifier.

    python bench/device_path.py SPLIT --rpc HOST:PORT [--batches 1,4,16] [--repeat 5] [--threads N]
                                [--compensation cpu|cuda|...|off]

Loads the split twice in this process: all local (every product replaced by the native kernels),
and with the base on the device (``--rpc``, or the GPU with ``--gpu``; every product completed in
add mode). For each batch size, a verify pass of that many rows after a 64-token context, timed in
turn: local, device with overlap, device without (interleaved, ``--repeat`` rounds, medians). Per
pass it reports the add mode's own counters: products completed, how many ran overlapped,
synchronisations (each observed node stops the device: products, plus the inputs asked for with
overlap), activation bytes moved each way, time in those transfers, time in ``R·x``, and time the
graph waited for an overlapped ``R·x``. Also timed in turn: the same pass on the device with the
residual off (``device_ms``: the base's layers alone, what the device costs), so that each mode's
**overhead per product** = (pass time - max(device time, host ``R·x`` time)) / products, in µs: what
add mode's synchronisations, copies and waking cost beyond the two computations it overlaps. The
last line is one JSON object; its top-level ``overhead_per_product_us`` (the median over the batches,
of the default path: overlap, the sum made on the device, uncompensated) is what ``bitsplit plan``
reads from a ``gpu_check*.json`` (``--product-overhead-us``).

Timed in turn too (unless ``--compensation off``): the pass with overlap and the device's rounding
compensated (native/compensate.c: a second product of the base on the device, ``W2 . (x - round(x))``,
the default of ``run``): ``compensated_ms``, ``compensation_cost`` (its ratio to the uncompensated
pass with overlap), and the time in those second products (the host's ``e``, the transfers, the
device's graph). The ``overhead_per_product_us`` figures are the uncompensated passes'. And the
sum on the device with the overlap started at each input's first product instead of the input
(``device_add_at_products``: ``--overlap-at products``, one stop per product).

**The device's own cost of stopping** (``stops_ms``, ``stops_products_ms``): the same pass with the
residual off, on a second context of the device model whose eval callback (a Python one, here)
stops the graph at the very nodes add mode stops at (each hooked product, and with overlap each
product's input, learned on a first pass) and does nothing there: what llama.cpp's scheduler and
the device's backend charge for those synchronisations alone (on its RPC client, each stop also
sends the graph view's whole ancestry again; the Python callback's own few µs per graph node are
in that figure too). Each mode's ``overhead_beyond_stops_us`` = (pass time
- max(that bare pass, host ``R·x`` time)) / products: what this library's own work at the stops
costs (copies, waking its threads, the device's add), the part its code can cut. On a loopback
RPC endpoint (Linux), ``wire_bytes``: what crossed the loopback interface during the pass (the
graph views, the activations, the replies), beside the activation bytes the library counts.

What it implies for a GPU over PCIe (the inputs ``bitsplit plan`` uses): ``plan`` charges each
hooked product ``2 * latency + activation bytes / B_pcie`` on top of the residual; these figures
give the number of synchronisations and the bytes per pass that formula multiplies.
"""

from __future__ import annotations

import argparse
import ctypes
import ipaddress
import json
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bitsplit_llama.runtime.verifier import SplitModel  # noqa: E402

CONTEXT = 64


class _Tensor(ctypes.Structure):
    """struct ggml_tensor of the pinned llama-cpp-python's ggml.h (GGML_MAX_DIMS 4, GGML_MAX_SRC 10,
    GGML_MAX_OP_PARAMS 64, GGML_MAX_NAME 64); checked against add mode's own counts before use"""


_Tensor._fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4),
                    ("nb", ctypes.c_size_t * 4), ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16),
                    ("flags", ctypes.c_int32), ("src", ctypes.POINTER(_Tensor) * 10), ("view_src", ctypes.c_void_p),
                    ("view_offs", ctypes.c_size_t), ("data", ctypes.c_void_p), ("name", ctypes.c_char * 64),
                    ("extra", ctypes.c_void_p), ("padding", ctypes.c_char * 8)]
_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.POINTER(_Tensor), ctypes.c_bool, ctypes.c_void_p)


class BareStops:
    """A context of ``sm``'s model (the base, on the device) whose eval callback stops the graph where
    add mode does, and does nothing there: ``mode`` "none" (no stop), "products" (after each product
    of a weight with a residual), "all" (also after each input of those)."""

    def __init__(self, sm: SplitModel, n_batch: int):
        import gguf

        from bitsplit_llama.runtime.llamacpp import Context

        self.weights = {t.name.encode() for t in gguf.GGUFReader(sm.residual.residual_path).tensors}
        self.feeds: set[bytes] = set()
        self.mode, self.stops = "learn", 0
        self._cb = _CALLBACK(self._callback)
        self.ctx = Context(sm.model, n_ctx=512, n_batch=n_batch, n_threads=sm.ctx.n_threads, op_offload=False,
                           cb_eval=ctypes.cast(self._cb, ctypes.c_void_p).value, cb_eval_user_data=0)
        self.ctx.decode([1] + [400 + i for i in range(CONTEXT - 1)], list(range(CONTEXT)), logits=False)

    def _callback(self, t, ask, _user):
        if not ask:
            self.stops += 1
            return True
        c = t.contents
        if self.mode == "none":
            return False
        # a product of a weight with a residual and an F32 activation (the token embedding's lookup, on the
        # host, is no stop of add mode's)
        if c.src[0] and c.src[0].contents.name in self.weights and c.src[1] and c.src[1].contents.type == 0:
            if self.mode == "learn":
                self.feeds.add(c.src[1].contents.name)
            return True
        return self.mode == "all" and c.name in self.feeds

    def run(self, rows: int, mode: str) -> tuple[float, int]:
        """one pass of ``rows`` rows after the context: seconds, stops"""
        self.mode, self.stops = mode, 0
        self.ctx.seq_rm(0, CONTEXT, -1)
        t0 = time.perf_counter()
        self.ctx.decode([300 + i for i in range(rows)], list(range(CONTEXT, CONTEXT + rows)))
        self.ctx.logits(rows)
        return time.perf_counter() - t0, self.stops

    def close(self) -> None:
        self.ctx.close()


def _loopback(endpoints: str | None) -> bool:
    """whether every RPC endpoint is on this machine's loopback (its traffic countable in /proc/net/dev)"""
    if not endpoints or not Path("/proc/net/dev").exists():
        return False
    for ep in endpoints.split(","):
        host = ep.rsplit(":", 1)[0].strip("[]")
        try:
            if not ipaddress.ip_address(socket.gethostbyname(host)).is_loopback:
                return False
        except (OSError, ValueError):
            return False
    return True


def _lo_bytes() -> int:
    """bytes received on the loopback interface so far (each byte sent over it is received once)"""
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name.strip() == "lo":
            return int(rest.split()[0])
    return 0


def _pass(sm: SplitModel, rows: int, verify: bool = True) -> tuple[float, object, object]:
    """One pass of ``rows`` rows after the context: the verifier's, or (``verify`` False) the base's
    alone (the residual hook off: on the device model, the device's own time)"""
    sm.ctx.seq_rm(0, CONTEXT, -1)
    c0 = sm.residual.counters()
    t0 = time.perf_counter()
    with (sm.verifying() if verify else sm.drafting()) as ctx:
        ctx.decode([300 + i for i in range(rows)], list(range(CONTEXT, CONTEXT + rows)))
        ctx.logits(rows)
    dt = time.perf_counter() - t0
    return dt, c0, sm.residual.counters()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("split")
    ap.add_argument("--rpc", help="HOST:PORT[,...] of llama.cpp RPC servers for the base")
    ap.add_argument("--gpu", action="store_true", help="the base on this machine's GPU instead (-ngl 99)")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="this process's threads (the server has its own)")
    ap.add_argument("--compensation", default=None, metavar="RULE",
                    help="also time passes with the device's rounding compensated by a second product on the device, "
                         "by this rule (default: cpu for --rpc, cuda for --gpu; off: not timed)")
    a = ap.parse_args()
    if bool(a.rpc) == a.gpu:
        ap.error("give exactly one of --rpc HOST:PORT or --gpu")
    batches = [int(b) for b in a.batches.split(",")]
    n_batch = max(batches + [CONTEXT])
    dev_kw = {"rpc": a.rpc} if a.rpc else {"n_gpu_layers": 99}
    comp = a.compensation or ("cpu" if a.rpc else "cuda")
    modes = ("overlap", "sequential") + (("compensated",) if comp != "off" else ()) + ("device_add",) + \
        (("device_add_compensated",) if comp != "off" else ()) + ("device_add_at_products",)
    local = SplitModel(a.split, n_ctx=512, n_batch=n_batch, n_threads=a.threads)
    dev = SplitModel(a.split, n_ctx=512, n_batch=n_batch, n_threads=a.threads, **dev_kw)
    out = {"split": a.split, "device": a.rpc or "gpu", "threads": local.ctx.n_threads, "batches": {},
           "compensation": comp}
    bare = None
    wire = _loopback(a.rpc)
    try:
        for sm in (local, dev):
            sm.ctx.clear()
            with sm.verifying() as ctx:
                ctx.decode([1] + [400 + i for i in range(CONTEXT - 1)], list(range(CONTEXT)), logits=False)
        bare = BareStops(dev, n_batch)
        for rows in batches:
            times = {"local": [], "device": [], "stops": [], "stops_products": [], **{m: [] for m in modes}}
            per = {m: [] for m in modes}
            wire_bytes = []
            _pass(dev, rows)  # learn the inputs (first pass) and warm up
            _pass(dev, rows, verify=False)
            _pass(local, rows)
            bare.run(rows, "learn")
            bare_stops = {}
            for _ in range(a.repeat):
                times["local"].append(_pass(local, rows)[0])
                times["device"].append(_pass(dev, rows, verify=False)[0])
                for key, bmode in (("stops", "all"), ("stops_products", "products")):
                    dt, n = bare.run(rows, bmode)
                    times[key].append(dt)
                    bare_stops[key] = n
                for mode in modes:
                    dev.residual.set_overlap(mode != "sequential", "products" if mode.endswith("at_products")
                                             else "inputs")
                    dev.residual.set_compensation(comp if mode.endswith("compensated") else "host")
                    dev.residual.set_device_add(mode.startswith("device_add"))
                    b0 = _lo_bytes() if wire else 0
                    dt, c0, c1 = _pass(dev, rows)
                    if wire and mode == "device_add":
                        wire_bytes.append(_lo_bytes() - b0)
                    times[mode].append(dt)
                    per[mode].append((c0, c1))
                dev.residual.set_compensation("host")
                dev.residual.set_device_add(False)
            row = {k: round(1e3 * statistics.median(v), 2) for k, v in times.items()}
            row = {f"{k}_ms": v for k, v in row.items()}
            for mode, pairs in per.items():
                c0, c1 = pairs[-1]
                prods = c1.n_add_products - c0.n_add_products
                ovl = c1.n_overlapped - c0.n_overlapped
                med = lambda f: round(1e3 * statistics.median(f(x, y) for x, y in pairs), 2)  # noqa: E731
                row[mode] = {
                    "products": prods, "overlapped": ovl,
                    "syncs": c1.n_stops - c0.n_stops,
                    "bytes_from_device": c1.bytes_from_device - c0.bytes_from_device,
                    "bytes_to_device": c1.bytes_to_device - c0.bytes_to_device,
                    "transfer_ms": med(lambda x, y: y.seconds_transfer - x.seconds_transfer),
                    "residual_ms": med(lambda x, y: y.seconds_inside - x.seconds_inside),
                    "wait_ms": med(lambda x, y: y.seconds_wait - x.seconds_wait),
                }
                if mode.endswith("compensated"):  # the second products: the host's e, the transfers, the device's graph
                    row[mode]["compensated"] = c1.n_compensated - c0.n_compensated
                    row[mode]["compensate_ms"] = med(lambda x, y: y.seconds_compensate - x.seconds_compensate)
                # µs per product that the pass took beyond a floor (ms): first the larger of the device's own
                # pass and the host's R . x (which overlap can hide behind each other at best):
                # synchronisations, copies, waking, the callback
                beyond = lambda floor: round(1e3 * (row[f"{mode}_ms"] - floor) / max(1, prods), 1)  # noqa: E731
                row[mode]["overhead_per_product_us"] = beyond(max(row["device_ms"], row[mode]["residual_ms"]))
                # beyond the device's own cost of the same stops, timed bare (uncompensated modes: the
                # compensated ones stop at the exact weights too and give the device more to compute)
                key = "stops_products" if mode in ("sequential", "device_add_at_products") else "stops"
                if not mode.endswith("compensated") and bare_stops.get(key) == row[mode]["syncs"]:
                    row[mode]["overhead_beyond_stops_us"] = beyond(max(row[f"{key}_ms"], row[mode]["residual_ms"]))
                row[mode]["syncs_per_product"] = round(row[mode]["syncs"] / max(1, prods), 2)
            row["overlap_gain"] = round(row["sequential_ms"] / row["overlap_ms"], 3)
            if "compensated" in modes:
                row["compensation_cost"] = round(row["compensated_ms"] / row["overlap_ms"], 3)
                row["device_add_compensation_cost"] = round(row["device_add_compensated_ms"] / row["device_add_ms"], 3)
            row["device_add_gain"] = round(row["overlap_ms"] / row["device_add_ms"], 3)
            row["device_vs_local"] = round(row["overlap_ms"] / row["local_ms"], 3)
            row["bare_stops"] = bare_stops
            if wire_bytes:
                row["device_add"]["wire_bytes"] = int(statistics.median(wire_bytes))
            out["batches"][rows] = row
            da = row["device_add"]
            if "overhead_beyond_stops_us" not in da:
                print(f"  (the bare pass stopped {bare_stops.get('stops')} times, add mode {da['syncs']}: not compared)",
                      file=sys.stderr)
            print(f"{rows:>3} rows: local {row['local_ms']:.1f} ms, device alone {row['device_ms']:.1f} ms, "
                  f"device+overlap {row['overlap_ms']:.1f} ms, "
                  f"device sequential {row['sequential_ms']:.1f} ms (overlap {row['overlap_gain']:.2f}x); per pass "
                  f"{row['overlap']['products']} products ({row['overlap']['overlapped']} overlapped), "
                  f"{row['overlap']['syncs']} syncs, {row['overlap']['bytes_from_device'] / 1e6:.2f} MB from / "
                  f"{row['overlap']['bytes_to_device'] / 1e6:.2f} MB to the device, transfers "
                  f"{row['overlap']['transfer_ms']:.1f} ms, R.x {row['overlap']['residual_ms']:.1f} ms, wait "
                  f"{row['overlap']['wait_ms']:.1f} ms; overhead per product {row['overlap']['overhead_per_product_us']:.0f} us "
                  f"(sequential {row['sequential']['overhead_per_product_us']:.0f} us)"
                  + (f"; compensated ({comp}) {row['compensated_ms']:.1f} ms ({row['compensation_cost']:.2f}x overlap's; "
                     f"second products {row['compensated']['compensate_ms']:.1f} ms, "
                     f"{row['compensated']['syncs']} syncs)" if "compensated" in modes else "")
                  + (f"; sum on the device {row['device_add_ms']:.1f} ms ({row['device_add_gain']:.2f}x faster than "
                     f"on the host; overhead per product {row['device_add']['overhead_per_product_us']:.0f} us)")
                  + (f", compensated {row['device_add_compensated_ms']:.1f} ms "
                     f"({row['device_add_compensation_cost']:.2f}x)" if "compensated" in modes else "")
                  + f"; the device stopping bare at the same {bare_stops.get('stops')} nodes {row['stops_ms']:.1f} ms "
                  f"({bare_stops.get('stops_products')} products only: {row['stops_products_ms']:.1f} ms)"
                  + (f", sum on the device beyond that {da['overhead_beyond_stops_us']:.0f} us per product"
                     if "overhead_beyond_stops_us" in da else "")
                  + (f"; {da['wire_bytes'] / 1e6:.1f} MB over loopback per pass with the sum on the device "
                     f"({(da['bytes_from_device'] + da['bytes_to_device']) / 1e6:.1f} MB of it activations)"
                     if "wire_bytes" in da else "")
                  + f"; started at the products (--overlap-at products) {row['device_add_at_products_ms']:.1f} ms, "
                  f"{row['device_add_at_products']['syncs']} syncs"
                  + (f", beyond its bare stops {row['device_add_at_products']['overhead_beyond_stops_us']:.0f} us per product"
                     if "overhead_beyond_stops_us" in row["device_add_at_products"] else ""),
                  file=sys.stderr, flush=True)
    finally:
        if bare is not None:
            bare.close()
        dev.close()
        local.close()
    out["overhead_per_product_us"] = round(statistics.median(
        r["device_add"]["overhead_per_product_us"] for r in out["batches"].values()), 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
