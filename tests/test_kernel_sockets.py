"""Kernels reached over Unix sockets (gpucourse.course.kernel_sockets): the path arithmetic against a real ZeroMQ bind,
the private folder's refusals, and a real kernel run over IPC the way the course's notebooks are run."""

from __future__ import annotations

import os
import uuid

import nbformat
import pytest
import zmq

from gpucourse.course import kernel_sockets, lab


def test_fits_is_exactly_what_zeromq_can_bind(short_tmp):
    """The longest folder that fits takes a kernel's longest socket name; one byte more does not bind."""
    longest = None
    for length in range(len(str(short_tmp)) + 2, 120):
        folder = short_tmp / ("a" * (length - len(str(short_tmp)) - 1))
        if not kernel_sockets.fits(folder):
            break
        longest = folder
    assert longest is not None
    context = zmq.Context()
    try:
        for folder, binds in ((longest, True), (longest.with_name(longest.name + "a"), False)):
            folder.mkdir()
            path = f"{folder}/kernel-{uuid.uuid4()}-ipc-999"  # jupyter_client's name, with a 3-digit channel
            socket = context.socket(zmq.PULL)
            try:
                socket.bind(f"ipc://{path}")
                bound = True
            except zmq.ZMQError:
                bound = False
            finally:
                socket.close(linger=0)
            assert bound is binds, (len(path), zmq.IPC_PATH_MAX_LEN)
    finally:
        context.term()


def test_a_private_folder_is_the_users_alone_and_a_shared_one_is_refused(short_tmp):
    folder = kernel_sockets.private_folder("seat01")
    assert folder == short_tmp / f"gpucourse-{os.getuid()}" / "seat01"
    assert all(p.stat().st_mode & 0o777 == 0o700 for p in (folder, folder.parent))
    assert kernel_sockets.private_folder("seat01") == folder  # made once, then reused
    os.chmod(folder.parent, 0o777)  # someone opened it to every account: another could replace the sockets
    with pytest.raises(kernel_sockets.KernelSocketError, match=r"is not a private folder of user \d+.*remove it"):
        kernel_sockets.private_folder("seat02")
    os.chmod(folder.parent, 0o700)
    elsewhere = short_tmp / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (folder.parent / "linked").symlink_to(elsewhere)
    with pytest.raises(kernel_sockets.KernelSocketError, match="linked is not a private folder"):
        kernel_sockets.private_folder("linked")


def test_a_kernel_outside_a_server_gets_ipc_and_a_short_folder(short_tmp, tmp_path):
    options = kernel_sockets.kernel_manager_options(short_tmp)
    assert options["transport"] == "ipc" and options["connection_file"].startswith(f"{short_tmp}/kernel-")
    too_long = short_tmp / ("x" * 80)
    moved = kernel_sockets.kernel_manager_options(too_long)["connection_file"]
    assert moved.startswith(f"{short_tmp}/gpucourse-{os.getuid()}/kernels/kernel-")
    # A real one, run as the course's notebooks are (lab.execute): its kernel reports IPC.
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("import json\nfrom ipykernel.connect import get_connection_info\n"
                                          "print(json.loads(get_connection_info())['transport'])")]
    kernels = lab.kernelspec_dir(tmp_path)
    lab.execute(nb, tmp_path / "transport.ipynb", kernels, name="gpucourse-course", smoke=False, cell_timeout=120)
    assert nb.cells[0].outputs[0]["text"].strip() == "ipc"
    assert not list(short_tmp.glob(f"gpucourse-{os.getuid()}/kernels/*")), "the kernel left its sockets behind"


def test_a_kernel_killed_outright_starts_again_on_its_own_sockets(short_tmp):
    """A kernel that dies leaves its socket files behind; restarted, it binds them again and answers."""
    import signal

    from jupyter_client.manager import KernelManager

    km = KernelManager(kernel_name="python3", **kernel_sockets.kernel_manager_options(short_tmp))
    km.start_kernel()
    try:
        for attempt in range(2):
            client = km.client()
            client.start_channels()
            try:
                client.wait_for_ready(timeout=60)
                reply = client.execute_interactive("x = 6 * 7", timeout=60)
                assert reply["content"]["status"] == "ok"
            finally:
                client.stop_channels()
            sockets = sorted(p.name for p in short_tmp.glob("kernel-*-ipc-*"))
            assert len(sockets) == 5, sockets  # shell, iopub, stdin, control, heartbeat: files, no TCP port
            if attempt == 0:
                os.kill(km.provisioner.process.pid, signal.SIGKILL)
                km.provisioner.process.wait()
                assert sorted(p.name for p in short_tmp.glob("kernel-*-ipc-*")) == sockets  # left behind
                km.restart_kernel(now=True)
    finally:
        km.shutdown_kernel(now=True)
    assert not list(short_tmp.glob("kernel-*")), "shutting down leaves no socket or connection file"


@pytest.mark.timeout(300)
def test_two_labs_started_at_once_run_their_kernels_over_ipc(tmp_path):
    """One learner's two `gpucourse lab` (LabServer runs its command line): started side by side, a kernel opened in
    each in the same moment runs over Unix sockets and listens on no TCP port a neighbour could be handed."""
    from concurrent.futures import ThreadPoolExecutor

    from gpucourse.workshop import kernels
    from procs import KERNEL_TRANSPORT

    servers = [lab.LabServer(tmp_path / name) for name in ("a", "b")]
    for server in servers:
        server.root.mkdir()
        (server.root / "notebooks").mkdir()  # where the check's session puts its kernel
        server.token = servers[0].token  # one token, so one request shape for both
    try:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda s: s.__enter__(), servers))
        found = kernels.open_all_at_once({f"lab{i}": f"http://127.0.0.1:{s.port}/api" for i, s in enumerate(servers)},
                                         servers[0].token, KERNEL_TRANSPORT, "ipc tcp ports 0", timeout=120)
        assert [r["problem"] for r in found] == [None, None], found
    finally:
        for server in servers:
            server.__exit__(None, None, None)
