"""The notebook cluster: ipyparallel engines as ranks.

A notebook process cannot be a rank of a multi-process job itself: it would have to block in
collectives, and one failing cell would take the whole group down. So the ranks live in
ipyparallel *engines*, and the notebook drives them. ``Cluster`` starts the engines with
ipyparallel's own launchers, joins them into one ``torch.distributed`` process group, and runs
functions on all of them at once.

Quick start
-----------

::

    from nbscaler.cluster import Cluster

    cl = Cluster(n=4, timeout=60)

    def world():
        import torch.distributed as dist
        return dist.get_rank(), dist.get_world_size()

    cl.run(world)          # [(0, 4), (1, 4), (2, 4), (3, 4)]
    cl.stop()

or, scoped, ``with Cluster(n=4) as cl: ...``. Element ``r`` of what ``run`` returns is rank
``r``'s return value. Functions and classes defined in the notebook itself work: they travel by
value (cloudpickle). Anything else a function uses must be importable on the engines; for a
checkout that is not installed, export ``PYTHONPATH`` before creating the cluster.

What every engine gets
----------------------

- **Its rank.** The engines of one host get consecutive ranks, in engine id order, and hosts follow
  the order of their first engine, fixed for the life of the engines. On one host rank ``r`` is the
  engine with the ``r``-th smallest engine id, and under ``mpiexec`` it is the MPI rank. So a unit of
  ``plan_ngpus`` ranks sits on one host whenever ``plan_ngpus`` divides the engines per host.
  ``cl.engines`` lists rank, engine id, host, address, interface, pid and local rank.
- **A process group.** gloo on CPU; with CUDA, nccl, with rank ``r`` on GPU ``local_rank``.
  ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and
  ``MASTER_PORT`` are set as ``torchrun`` sets them, so code written for ``torchrun`` runs unchanged.
- **Its own address.** Each engine talks on the address that routes to the controller (loopback
  when everything is on this host), or on ``network=`` (an interface name or a subnet), and points
  ``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME`` at that interface unless they are already set.
  Rank 0's address is the rendezvous (``MASTER_ADDR``); nothing assumes one host.
- **Its share of the cores.** ``torch.set_num_threads`` and ``OMP_NUM_THREADS`` are a host's cores
  divided by its engines (``threads=`` overrides it).
- **Its own files.** Each cluster has its own ipyparallel profile folder (a temporary one unless
  ``profile_dir=`` is given) and cluster id, so clusters never pick up each other's connection files.

Re-running cells
----------------

One cluster per ``name`` (default ``"default"``) runs in a kernel. Running ``Cluster(n=4)`` again,
as a re-run cell does, takes over the running engines when every setting is equal: no new
processes, and the process group is not initialised again. When a setting differs, the old engines
are stopped first. So re-running a cell never leaks engines. The object you had before stops
working, with an error that says so; use the new one.

``stop()``, or leaving the ``with`` block, ends the controller, every engine and their helper
processes, waits until they are gone, and removes the temporary profile folder. Clusters still
running when the kernel exits are stopped as well, and a watchdog process per cluster ends them
when the kernel is killed instead.

When things go wrong
--------------------

``timeout`` is the process group's timeout: how long a collective waits for a missing peer.

- **A rank raises.** ``run`` raises ``RankError`` naming the rank that failed first, with its
  traceback from the engine. The failing rank closes its connections before it answers, so peers
  stuck in a collective with it are released at once; ranks still busy a few seconds later are
  interrupted. The next ``run`` rebuilds the process group on the same engines, without a restart.
- **A collective hangs** (a rank never joins it): the waiting ranks fail after ``timeout``, the
  others are interrupted, and ``run`` raises ``RankError`` as above.
- **An engine dies** (killed, segfault, out of memory): ``run`` raises ``RankDied`` naming the rank,
  engine and pid. The group has lost a member, so further calls raise ``ClusterError`` until
  ``cl.restart()`` has started fresh engines with a new group.
- **Engines fail to start** (bad launcher options, ``mpiexec`` refusing to run): the constructor
  raises ``ClusterError`` with the launcher's output.

An error reaches the notebook within seconds when ranks fail outright, and within
``2 * timeout + 10`` seconds in the worst case. Interrupting the notebook (the stop button) while
``run`` waits interrupts the engines too, and the next call rebuilds the group as after an error.

A rebuilt group is a new one: the subgroups of tensor and pipeline parallelism are made again from
it, and a module parallelized before the failure asks to be parallelized again (with any policy).
Only a dead engine needs ``restart()``.

Parallelize, train, infer
-------------------------

``cl.parallelize`` takes the arguments of ``nbscaler.parallelize`` and runs it on every rank: rank 0
compiles (or reuses an earlier compile), the others wait and load their own generated code. The
broadcast strategy is honoured; by default it is ``'none'`` when all engines share this host and
``'all'`` otherwise. What comes back is a ``RemoteModule``, a handle; the shards stay on the ranks.

::

    pm = cl.parallelize(model, {'x': x, 'y': y}, 'tp', ComputeConfig(plan_ngpus=2, runtime_ngpus=4))

    def data(step, unit):          # runs on the ranks; a unit is one data-parallel copy
        g = torch.Generator().manual_seed(step * 100 + unit)
        return {'x': torch.randn(8, 16, generator=g), 'y': torch.randint(0, 4, (8,), generator=g)}

    result = pm.train(data, steps=50, optimizer_fn=torch.optim.AdamW, lr=1e-3)
    result.losses.plot()           # loss by step, one line per rank
    pm.infer(data(0, 0))[0]        # rank 0's output

``train`` builds the optimizer with ``nbscaler.build_optimizer`` on its first call and keeps it
(and the step count) for later calls, shows a progress bar that follows the slowest rank, and
returns a ``TrainResult`` of pandas DataFrames: ``steps`` (rank, unit, step, loss, t_start, t_end,
step_time), ``memory`` (parameter, gradient and optimizer bytes and peak memory per rank) and, for
pipelines, ``schedule`` (rank, step, stage, micro, phase, t_start, t_end: the measured timeline,
also as ``result.timeline(step)`` with its bubble fraction).
``after_backward(module, optimizer, step)`` runs on the ranks between backward and the optimizer
step and its return values come back in ``probes``; ``pm.run(fn)`` runs ``fn(module)`` on every
rank. The rank side is plain code (``nbscaler.cluster.training``), so the same run under
``torchrun`` or ``spawn`` gives the same numbers.

Progress and ``%px``
--------------------

A function can call ``report(step=i, loss=...)`` on the engines. ``cl.call(fn, args,
on_report=handler)`` hands ``handler`` the latest report of every rank while the call runs;
``report`` does nothing outside a cluster, so the same function runs under ``torchrun`` too.

``cl.view`` is a blocking ipyparallel view of the engines in rank order and ``cl.client`` the
client. When the cluster starts under IPython, ``%px`` and ``%%px`` are pointed at it; with
several clusters they follow the one started last, and ``cl.view.activate()`` points them back.

Engines elsewhere: MPI and Slurm
--------------------------------

``engines=`` names the ipyparallel engine launcher; the rest of the API does not change.

- ``engines='local'`` (default): engine processes on this machine.
- ``engines='mpi'``: one ``mpiexec`` starts all engines, and ranks follow MPI ranks. It needs an
  MPI (``apt-get install openmpi-bin libopenmpi-dev``) and ``mpi4py`` (``pip install
  'nbscaler[mpi]'``). For Open MPI, nbscaler allows more ranks than cores and, when running as
  root, sets the variables that let ``mpiexec`` run as root. Hosts and other ``mpiexec`` flags go
  in ``launcher_options={'mpi_args': ['--hostfile', 'hosts']}``.
- ``engines='slurm'``: the engines run as one ``sbatch`` job of ``n`` tasks (``srun``). Queue,
  time limit and account go in ``launcher_options={'queue': 'gpu', 'timelimit': '2:00:00',
  'account': 'me'}``. The engines then run on other hosts, so: the controller listens on this
  host's address on ``network=`` (or of its host name), never on every interface; name another
  with ``cluster_options={'controller_ip': '10.1.0.5'}``. Give ``start_timeout`` for the time the
  job may wait in the queue; make nbscaler importable on the nodes. Rank 0's address is the
  rendezvous, and its store listens there alone; give ``network=`` when the route to the
  controller is not the network the ranks should use.
  ``cl.job_id`` is the job; if Slurm ends it (``scancel``, time limit), the next call raises
  ``RankDied`` naming the job and the state Slurm gives it, and ``restart()`` submits a new job.
- Any other ipyparallel launcher (``'pbs'``, ``'sge'``, ``'lsf'``, ``'ssh'``, a class) is passed on
  unchanged, with its options in ``launcher_options``.
"""

from nbscaler.cluster.cluster import Cluster
from nbscaler.cluster.engine import report
from nbscaler.cluster.errors import ClusterError, RankDied, RankError
from nbscaler.cluster.remote import RemoteModule, TrainResult
from nbscaler.cluster.session import ClusterSpec, EngineSlot

__all__ = ["Cluster", "ClusterError", "ClusterSpec", "EngineSlot", "RankDied", "RankError", "RemoteModule",
           "TrainResult", "report"]
