"""llama.cpp's RPC backend: a device whose buffers live in another process or on another machine.

For this project it is the device path without a GPU: the base's layers (``-ngl``) live on an RPC
server, the host cannot touch their buffers (``ggml_backend_buffer_is_host`` is false), so every
residual product is completed in add mode exactly as it would be with the base on a GPU. It is also
llama.cpp's own way of spreading a model over several machines.

- :func:`serve` runs a server backed by this machine's CPU (``bitsplit rpc-server``), in the
  foreground, through ``ggml_backend_rpc_start_server``: no separate binary.
- :func:`connect` turns ``HOST:PORT[,...]`` into the NULL-terminated device list that
  ``llama_model_params.devices`` takes. Before handing an endpoint to llama.cpp it checks, from
  Python and with a bounded wait, that a server of a compatible protocol answers there: llama.cpp's
  RPC client aborts the process on any failure, so a refused or silent server is reported here
  instead. The client's sockets then get a receive/send timeout, so a server that dies or stops
  answering mid-generation ends the process with one message (:func:`arm_abort_message`) after at
  most that timeout, instead of hanging; llama.cpp's client cannot recover a lost connection.

The RPC backend is in llama-cpp-python only when it was built with ``CMAKE_ARGS=-DGGML_RPC=on``.
pip's wheel cache does not key on ``CMAKE_ARGS``, so a wheel built earlier without it is reused
silently; :func:`require` detects that and says how to rebuild.
"""

from __future__ import annotations

import ctypes
import errno
import ipaddress
import os
import socket
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

from ..errors import BitsplitError, InvalidOptionError

DEFAULT_PORT = 50052
DEFAULT_TIMEOUT_S = 60.0
MAX_SERVERS = 16  # GGML_RPC_MAX_SERVERS

# The wire protocol's first exchange (ggml-rpc.cpp): | cmd u8 | size u64 | request | -> | size u64 |
# response |. HELLO is command 14 in every protocol version; its request is the connection's
# capability bytes, its response major, minor, patch, padding and the server's capability bytes.
_CMD_HELLO = 14
_CONN_CAPS = 24  # RPC_CONN_CAPS_SIZE (transport.h)
PROTO_MAJOR, PROTO_MINOR = 7, 0  # ggml-rpc.h of the pinned llama-cpp-python (0.3.36)

REBUILD = ("python -m pip cache remove 'llama_cpp_python*'; CMAKE_ARGS=\"-DGGML_RPC=on\" python -m pip install "
           "--force-reinstall --no-deps llama-cpp-python==0.3.36")


class RpcError(BitsplitError):
    """An RPC server cannot be used: not reachable, not answering, another protocol, or no RPC build."""


class RpcUnavailableError(RpcError):
    """This llama-cpp-python was built without the RPC backend."""


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def loopback(self) -> bool:
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False


def parse_endpoints(spec: str, option: str = "--rpc") -> list[Endpoint]:
    """``HOST:PORT[,HOST:PORT...]`` into endpoints, or one clear error. llama.cpp's RPC transport
    takes a host name or an IPv4 address (it splits the endpoint at its first colon)."""
    if not isinstance(spec, str) or not spec.strip():
        raise InvalidOptionError(f"{option}: empty; expected HOST:PORT[,HOST:PORT...], e.g. 127.0.0.1:{DEFAULT_PORT}")
    out: list[Endpoint] = []
    for item in spec.split(","):
        item = item.strip()
        host, sep, port = item.rpartition(":")
        if ":" in host or "[" in host:
            raise InvalidOptionError(f"{option}: {item!r}: llama.cpp's RPC backend takes a host name or an IPv4 "
                                     "address, not IPv6")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise InvalidOptionError(f"{option}: {item!r} is not HOST:PORT (a port from 1 to 65535), "
                                     f"e.g. 127.0.0.1:{DEFAULT_PORT}")
        ep = Endpoint(host, int(port))
        if ep in out:
            raise InvalidOptionError(f"{option}: {ep} is given twice")
        out.append(ep)
    if len(out) > MAX_SERVERS:
        raise InvalidOptionError(f"{option}: {len(out)} servers; llama.cpp takes at most {MAX_SERVERS}")
    return out


def check_timeout(timeout_s: float, option: str = "--rpc-timeout") -> float:
    if not isinstance(timeout_s, (int, float)) or not timeout_s > 0 or timeout_s > 86400:
        raise InvalidOptionError(f"{option}: {timeout_s!r} is not a number of seconds in (0, 86400]")
    return float(timeout_s)


# -------------------------------------------------------------------------------------------------
# the libraries
# -------------------------------------------------------------------------------------------------

_libs: dict[str, ctypes.CDLL] = {}
_attached: set[int] = set()  # Devices whose model is loaded (the abort message is armed while any is)


def _lib_dir() -> Path:
    import llama_cpp

    return Path(llama_cpp.__file__).parent / "lib"


def available() -> bool:
    """Whether this llama-cpp-python has the RPC backend."""
    try:
        import llama_cpp

        return bool(llama_cpp.llama_supports_rpc()) and any(_lib_dir().glob("libggml-rpc.*"))
    except Exception:
        return False


def require() -> None:
    if not available():
        raise RpcUnavailableError(
            "--rpc needs llama-cpp-python built with llama.cpp's RPC backend, and the installed one was "
            f"built without it (pip may have reused a cached wheel: its cache ignores CMAKE_ARGS); rebuild it with: "
            f"{REBUILD}")


def _load() -> tuple[ctypes.CDLL, ctypes.CDLL, ctypes.CDLL]:
    require()
    if not _libs:
        import llama_cpp

        llama_cpp.llama_backend_init()  # loads and registers llama.cpp's backends
        d = _lib_dir()

        def lib(stem: str) -> ctypes.CDLL:
            cands = sorted(d.glob(f"lib{stem}.so*")) + sorted(d.glob(f"lib{stem}.dylib")) + sorted(d.glob(f"{stem}.dll"))
            if not cands:
                raise RpcUnavailableError(f"{d}: lib{stem} not found; rebuild llama-cpp-python with: {REBUILD}")
            return ctypes.CDLL(str(cands[0]))

        base, ggml, rpc = lib("ggml-base"), lib("ggml"), lib("ggml-rpc")
        vp, sz = ctypes.c_void_p, ctypes.c_size_t
        rpc.ggml_backend_rpc_add_server.restype = vp
        rpc.ggml_backend_rpc_add_server.argtypes = [ctypes.c_char_p]
        rpc.ggml_backend_rpc_start_server.restype = None
        rpc.ggml_backend_rpc_start_server.argtypes = [ctypes.c_char_p, ctypes.c_char_p, sz, sz, vp]
        base.ggml_backend_reg_dev_count.restype = sz
        base.ggml_backend_reg_dev_count.argtypes = [vp]
        base.ggml_backend_reg_dev_get.restype = vp
        base.ggml_backend_reg_dev_get.argtypes = [vp, sz]
        base.ggml_backend_dev_description.restype = ctypes.c_char_p
        base.ggml_backend_dev_description.argtypes = [vp]
        ggml.ggml_backend_dev_by_type.restype = vp
        ggml.ggml_backend_dev_by_type.argtypes = [ctypes.c_int]
        _libs.update(base=base, ggml=ggml, rpc=rpc)
    return _libs["base"], _libs["ggml"], _libs["rpc"]


def gpu_names() -> list[str]:
    """The GPU devices llama.cpp sees in this process, by name ("CUDA0", "Vulkan0", "Metal"...; RPC not
    counted)."""
    import llama_cpp

    llama_cpp.llama_backend_init()
    d = _lib_dir()
    cands = sorted(d.glob("libggml.so*")) + sorted(d.glob("libggml.dylib")) + sorted(d.glob("ggml.dll"))
    if not cands:
        return []
    g = ctypes.CDLL(str(cands[0]))
    g.ggml_backend_dev_count.restype = ctypes.c_size_t
    g.ggml_backend_dev_get.restype = ctypes.c_void_p
    g.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
    g.ggml_backend_dev_type.restype = ctypes.c_int
    g.ggml_backend_dev_type.argtypes = [ctypes.c_void_p]
    g.ggml_backend_dev_name.restype = ctypes.c_char_p
    g.ggml_backend_dev_name.argtypes = [ctypes.c_void_p]
    devs = [g.ggml_backend_dev_get(i) for i in range(g.ggml_backend_dev_count())]
    return [(g.ggml_backend_dev_name(d) or b"?").decode(errors="replace") for d in devs
            if g.ggml_backend_dev_type(d) in (1, 2)]  # GPU, IGPU


def gpu_count() -> int:
    """How many GPU devices llama.cpp sees in this process (CUDA, Vulkan, Metal...; RPC not counted)."""
    return len(gpu_names())


#: --compensation: the rounding rules a device can be compensated by (native/numerics.c), or the choice
COMPENSATIONS = ("auto", "off", "cpu", "cuda", "cuda-mmvq", "metal")


def check_compensation(value: str) -> str:
    if value not in COMPENSATIONS:
        raise InvalidOptionError(f"--compensation: '{value}' unknown (expected one of: {', '.join(COMPENSATIONS)})")
    return value


def compensation_rule(setting: str, rpc: bool, n_gpu_layers: int) -> str:
    """The rounding rule the device holding the base is compensated by ("host": none): ``setting``
    itself, or for "auto" the rule of the device it is: an RPC server's llama.cpp CPU backend ("cpu";
    ``bitsplit rpc-server`` serves the CPU), CUDA ("cuda"), Metal ("metal"); other GPUs (Vulkan, SYCL...)
    have no rule written here, so none (docs/device-path.md)."""
    if setting == "off" or not (rpc or n_gpu_layers > 0):
        return "host"
    if setting != "auto":
        return setting
    if rpc:
        return "cpu"
    names = gpu_names()
    if names and all(n.upper().startswith("CUDA") for n in names):
        return "cuda"
    if names and all(n.upper().startswith(("METAL", "MTL")) for n in names):
        return "metal"
    return "host"


# -------------------------------------------------------------------------------------------------
# the client side
# -------------------------------------------------------------------------------------------------

def _recv_exact(s: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("the server closed the connection")
        buf += chunk
    return bytes(buf)


def hello(ep: Endpoint, timeout_s: float) -> tuple[int, int, int]:
    """The server's protocol version, from the protocol's own handshake, within ``timeout_s``.

    The server serves one client at a time: one busy with another client accepts the connection
    but does not answer, which this reports as not answering."""
    try:
        with socket.create_connection((ep.host, ep.port), timeout=timeout_s) as s:
            s.sendall(struct.pack("<BQ", _CMD_HELLO, _CONN_CAPS) + bytes(_CONN_CAPS))
            (size,) = struct.unpack("<Q", _recv_exact(s, 8))
            if size != 4 + _CONN_CAPS:
                raise RpcError(f"RPC server {ep}: unexpected handshake answer ({size} bytes); is it a llama.cpp RPC "
                               f"server of protocol {PROTO_MAJOR}.x?")
            major, minor, patch = _recv_exact(s, size)[:3]
    except socket.timeout:
        raise RpcError(f"RPC server {ep}: no answer within {timeout_s:g} s (the server serves one client at a "
                       "time: is another one connected?)") from None
    except ConnectionRefusedError:
        raise RpcError(f"RPC server {ep}: connection refused; start one there with "
                       f"`bitsplit rpc-server --host {ep.host} --port {ep.port}`") from None
    except (OSError, ConnectionError) as e:
        raise RpcError(f"RPC server {ep}: {getattr(e, 'strerror', None) or e}") from None
    if major != PROTO_MAJOR or minor > PROTO_MINOR:
        raise RpcError(f"RPC server {ep} speaks RPC protocol {major}.{minor}.{patch}; this llama.cpp speaks "
                       f"{PROTO_MAJOR}.{PROTO_MINOR} (run the same llama.cpp version on both sides)")
    return major, minor, patch


def _client_sockets(eps: list[Endpoint]) -> list[int]:
    """This process's TCP sockets connected to one of ``eps`` (Linux: from /proc/self/fd)."""
    want = set()
    for ep in eps:
        try:
            for info in socket.getaddrinfo(ep.host, ep.port, type=socket.SOCK_STREAM):
                want.add((info[4][0], ep.port))
        except OSError:
            pass
    fds = []
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return fds
    for name in names:
        fd = int(name)
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            peer = s.getpeername()
            if s.type == socket.SOCK_STREAM and (peer[0], peer[1]) in want:
                fds.append(fd)
        except (OSError, IndexError, TypeError):
            pass
        finally:
            s.close()  # closes the duplicate only
    return fds


def _set_timeouts(fds: list[int], timeout_s: float) -> None:
    sec = int(timeout_s)
    tv = struct.pack("ll", sec, int((timeout_s - sec) * 1e6))
    for fd in fds:
        s = socket.socket(fileno=os.dup(fd))  # socket options belong to the socket, not the descriptor
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
        finally:
            s.close()


class Devices:
    """The RPC devices of ``endpoints``, as llama.cpp's NULL-terminated ``ggml_backend_dev_t`` list.

    ``pointer`` goes into ``llama_model_params.devices`` (kept alive by this object); call
    :meth:`attach` once the model is loaded. llama.cpp keeps one connection per server while
    something (a buffer, a backend) uses it; the load itself runs without the timeout."""

    def __init__(self, endpoints: list[Endpoint], timeout_s: float = DEFAULT_TIMEOUT_S):
        self.endpoints = list(endpoints)
        self.timeout_s = check_timeout(timeout_s)
        base, _, rpc = _load()
        for ep in self.endpoints:
            hello(ep, min(self.timeout_s, 10.0))
        devs, self.names = [], []
        for ep in self.endpoints:
            reg = rpc.ggml_backend_rpc_add_server(str(ep).encode())
            n = base.ggml_backend_reg_dev_count(reg) if reg else 0
            if n == 0:
                raise RpcError(f"RPC server {ep}: it offers no device")
            for i in range(n):
                dev = base.ggml_backend_reg_dev_get(reg, i)
                devs.append(dev)
                desc = base.ggml_backend_dev_description(dev)
                self.names.append(f"{ep}/{i} ({desc.decode(errors='replace') if desc else '?'})")
        self._array = (ctypes.c_void_p * (len(devs) + 1))(*devs, None)
        self.sockets: list[int] = []

    def attach(self) -> None:
        """After a model is loaded on these devices (its buffers hold llama.cpp's one connection per
        server open): give those connections the timeout, and arm the abort message."""
        self.sockets = _client_sockets(self.endpoints)
        _set_timeouts(self.sockets, self.timeout_s)
        _attached.add(id(self))
        arm_abort_message(self.endpoints, self.timeout_s)

    def detach(self) -> None:
        """The model on these devices is freed: once no model uses RPC any more, llama.cpp's aborts
        get their own message back."""
        _attached.discard(id(self))
        self.sockets = []  # llama.cpp closed them with the model; the numbers may be reused
        if not _attached:
            from .. import native

            native.set_abort_message(None)

    def dead(self) -> str | None:
        """The first server whose connection is closed (it died or hung up), or None. A look at the
        client's own sockets, without sending anything: the server serves one client, us, so a new
        connection would not be answered."""
        for fd in self.sockets:
            try:
                s = socket.socket(fileno=os.dup(fd))
            except OSError:
                return ",".join(str(e) for e in self.endpoints)
            try:
                peer = s.getpeername()
                data = s.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
                if data == b"":
                    return f"{peer[0]}:{peer[1]}"
            except BlockingIOError:
                continue  # open, nothing to read: alive
            except OSError:
                return ",".join(str(e) for e in self.endpoints)
            finally:
                s.close()
        return None

    def check_alive(self) -> None:
        """Raise :class:`RpcError` if a server hung up (before llama.cpp talks to it and aborts)."""
        who = self.dead()
        if who is not None:
            raise RpcError(f"RPC server {who} closed the connection (it stopped or was restarted); this model "
                           "cannot be used any more: close it and load it again")

    @property
    def pointer(self) -> int:
        return ctypes.addressof(self._array)

    def __len__(self) -> int:
        return len(self.names)


def connect(spec: str | list[str] | None, timeout_s: float = DEFAULT_TIMEOUT_S) -> Devices | None:
    """``--rpc`` (a string, or a list of ``HOST:PORT``) as devices, or None when not given."""
    if spec is None or spec == "" or spec == []:
        return None
    if not isinstance(spec, str):
        spec = ",".join(spec)
    return Devices(parse_endpoints(spec), timeout_s)


def arm_abort_message(endpoints: list[Endpoint], timeout_s: float) -> None:
    """From now on, a llama.cpp abort (its RPC client aborts on a lost connection) prints one line
    naming the servers, instead of llama.cpp's assertion and stack trace, and exits with status 1."""
    from .. import native

    eps = ",".join(str(e) for e in endpoints)
    native.set_abort_message(
        f"bitsplit: lost the RPC device {eps} (the server died, closed the connection or did not answer "
        f"within {timeout_s:g} s); llama.cpp cannot continue without it")


# -------------------------------------------------------------------------------------------------
# the server side
# -------------------------------------------------------------------------------------------------

def check_port_free(ep: Endpoint) -> None:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((ep.host, ep.port))
    except OSError as e:
        why = "already in use" if e.errno == errno.EADDRINUSE else (e.strerror or str(e))
        raise RpcError(f"rpc-server: cannot listen on {ep}: {why}") from None


def serve(ep: Endpoint, threads: int, cache_dir: str | None = None) -> None:
    """Run an RPC server backed by this machine's CPU until the process is stopped (blocks)."""
    _, ggml, rpc = _load()
    check_port_free(ep)
    cpu = ggml.ggml_backend_dev_by_type(0)  # GGML_BACKEND_DEVICE_TYPE_CPU
    if not cpu:
        raise RpcError("rpc-server: llama.cpp has no CPU device")
    devs = (ctypes.c_void_p * 1)(cpu)
    rpc.ggml_backend_rpc_start_server(str(ep).encode(), cache_dir.encode() if cache_dir else None, int(threads), 1,
                                      ctypes.addressof(devs))
    raise RpcError(f"rpc-server: llama.cpp's server on {ep} stopped (see its message above)")
