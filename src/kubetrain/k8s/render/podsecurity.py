"""The Pod Security Standard "restricted" profile (which includes "baseline"), checked on a pod spec.

The same rules the API server's PodSecurity admission enforces in a namespace labelled
`pod-security.kubernetes.io/enforce: restricted`, so a job rendered here is admitted there.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

RESTRICTED_VOLUME_TYPES = {
    "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected",
    "secret", "image",
}
SAFE_SYSCTLS = {
    "kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
}
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}


def _containers(spec: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for key in ("initContainers", "containers", "ephemeralContainers"):
        yield from spec.get(key) or []


def restricted_violations(spec: dict[str, Any]) -> list[str]:
    """Every rule of the restricted profile that this PodSpec breaks (empty: it is admitted)."""
    out: list[str] = []
    pod_sc = spec.get("securityContext") or {}
    out.extend(_host_violations(spec, pod_sc))
    for vol in spec.get("volumes") or []:
        bad = set(vol) - {"name"} - RESTRICTED_VOLUME_TYPES
        if bad:
            out.append(f"volume {vol.get('name')} has type {', '.join(sorted(bad))}")
    out.extend(_context_violations("pod", pod_sc))
    pod_seccomp = (pod_sc.get("seccompProfile") or {}).get("type")
    for c in _containers(spec):
        name = f"container {c.get('name')}"
        sc = c.get("securityContext") or {}
        out.extend(_context_violations(name, sc))
        if sc.get("privileged"):
            out.append(f"{name}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{name}: allowPrivilegeEscalation is not false")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            out.append(f"{name}: capabilities do not drop ALL")
        for cap in caps.get("add") or []:
            if cap != "NET_BIND_SERVICE":
                out.append(f"{name}: adds capability {cap}")
        if sc.get("procMount") not in (None, "Default"):
            out.append(f"{name}: procMount {sc['procMount']}")
        non_root = sc.get("runAsNonRoot")
        if not (non_root or (pod_sc.get("runAsNonRoot") and non_root is not False)):
            out.append(f"{name}: runAsNonRoot is not true (pod or container)")
        seccomp = (sc.get("seccompProfile") or {}).get("type") or pod_seccomp
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"{name}: seccompProfile is {seccomp or 'unset'}, not RuntimeDefault or Localhost")
        for port in c.get("ports") or []:
            if port.get("hostPort"):
                out.append(f"{name}: hostPort {port['hostPort']}")
    return out


def _host_violations(spec: dict[str, Any], pod_sc: dict[str, Any]) -> list[str]:
    """Rules of both profiles: no host namespaces, only the safe sysctls."""
    out = [f"{key} is true" for key in ("hostNetwork", "hostPID", "hostIPC") if spec.get(key)]
    for sysctl in pod_sc.get("sysctls") or []:
        if sysctl.get("name") not in SAFE_SYSCTLS:
            out.append(f"sysctl {sysctl.get('name')} is not in the safe set")
    return out


def _context_violations(where: str, sc: dict[str, Any]) -> list[str]:
    """Rules that apply alike to the pod's and to each container's security context."""
    out = []
    if sc.get("runAsUser") == 0:
        out.append(f"{where}: runAsUser is 0 (root)")
    if (sc.get("windowsOptions") or {}).get("hostProcess"):
        out.append(f"{where}: windowsOptions.hostProcess is true")
    if (sc.get("seccompProfile") or {}).get("type") == "Unconfined":
        out.append(f"{where}: seccompProfile is Unconfined")
    if (sc.get("appArmorProfile") or {}).get("type") not in (None, "RuntimeDefault", "Localhost"):
        out.append(f"{where}: appArmorProfile is {sc['appArmorProfile']['type']}")
    se = sc.get("seLinuxOptions") or {}
    if se.get("type", "") not in SELINUX_TYPES or se.get("user") or se.get("role"):
        out.append(f"{where}: seLinuxOptions not allowed ({se})")
    return out


# Capabilities the "baseline" profile lets a container add (the Pod Security Standards' list).
BASELINE_CAPABILITIES = {
    "AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD", "NET_BIND_SERVICE", "SETFCAP",
    "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT",
}


def baseline_violations(spec: dict[str, Any]) -> list[str]:
    """Every rule of the baseline profile that this PodSpec breaks (empty: a 'baseline' namespace admits it)."""
    out: list[str] = []
    pod_sc = spec.get("securityContext") or {}
    out.extend(_host_violations(spec, pod_sc))
    for vol in spec.get("volumes") or []:
        if "hostPath" in vol:
            out.append(f"volume {vol.get('name')} is a hostPath")
    contexts = [("pod", pod_sc)] + [(f"container {c.get('name')}", c.get("securityContext") or {})
                                    for c in _containers(spec)]
    for where, sc in contexts:
        out.extend(v for v in _context_violations(where, sc) if "runAsUser is 0" not in v)  # root: restricted only
    for c in _containers(spec):
        name, sc = f"container {c.get('name')}", c.get("securityContext") or {}
        if sc.get("privileged"):
            out.append(f"{name}: privileged")
        for cap in (sc.get("capabilities") or {}).get("add") or []:
            if cap not in BASELINE_CAPABILITIES:
                out.append(f"{name}: adds capability {cap}")
        if sc.get("procMount") not in (None, "Default"):
            out.append(f"{name}: procMount {sc['procMount']}")
        out.extend(f"{name}: hostPort {p['hostPort']}" for p in c.get("ports") or [] if p.get("hostPort"))
    return out


def level(spec: dict[str, Any]) -> str:
    """The strictest Pod Security Standard this PodSpec meets: restricted, baseline or privileged."""
    if not restricted_violations(spec):
        return "restricted"
    return "baseline" if not baseline_violations(spec) else "privileged"


def level_note(pod_specs: list[dict[str, Any]]) -> str | None:
    """One line when the rendered pods fall short of "restricted" (None when they meet it)."""
    levels = {level(spec) for spec in pod_specs}
    if not levels or levels == {"restricted"}:
        return None
    worst = "privileged" if "privileged" in levels else "baseline"
    why = sorted({v for spec in pod_specs for v in restricted_violations(spec)})
    return (f"note: the pods meet Pod Security '{worst}', not 'restricted' ({'; '.join(why)}): "
            f"their namespace must admit '{worst}' pods (pod-security.kubernetes.io/enforce)")
