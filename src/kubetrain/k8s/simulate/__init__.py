"""Run a job's pods as local processes: the multi-pod path (entrypoint, rendezvous, resume) without a cluster.

Each pod runs the container's own command and arguments with the environment its controller would give it
(controllers.py: JOB_COMPLETION_INDEX and hostname for an Indexed Job, RANK/WORLD_SIZE/PET_* for a PyTorchJob, ...).
What a cluster provides is mapped onto this machine: the job's DNS names to 127.0.0.1, the rendezvous port to a
free local port (network.py), each volume to a local folder (volumes.py: a claim shared by the pods, a folder of the
user's with `--volume NAME=PATH`; emptyDirs per pod), and the controller's restart of failed pods (backoffLimit,
podFailurePolicy) is done by the supervisor (simulation.py). The pods share one host where a cluster gives each its
own network namespace, so each pod gets its own metrics and launcher ports (its copy of the ConfigMap names them).
Each pod is probed as its kubelet would (kubelet.py: the HTTP prober's request for the rendered startup and
liveness probes), and a container whose probe failed failureThreshold times in a row is ended as the kubelet ends
it.
"""
