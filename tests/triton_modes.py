"""Triton picks its interpreter when it is first imported, so a session that imported it earlier cannot run kernel
tests on the CPU in-process. Such a module keeps either its kernel tests (run here) or only ``test_in_subprocess``
(which runs the same file in a fresh interpreter): never both, and never a skipped stand-in."""


def keep_one_mode(namespace: dict, in_process: bool) -> None:
    for name in [n for n in namespace if n.startswith("test_")]:
        if (name == "test_in_subprocess") == in_process:
            del namespace[name]
