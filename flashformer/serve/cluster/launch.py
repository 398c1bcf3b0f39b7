"""serve_replicas: `flashformer serve MODEL --replicas N`: N engine replicas as one Ray Serve
deployment (EngineReplica, routed by PrefixAffinityRouter), behind the same HTTP app on one port.

    ray.init (a local cluster, or --ray-address's) -> serve.start without Serve's HTTP proxy
    -> the deployment: N replicas, each --threads threads and as many of Ray's CPUs
    -> this process: serve.app's create_app over a RemoteEngine (the deployment's handle), uvicorn

The app runs here, in the process the user started, not behind Ray Serve's HTTP proxy: the proxy
hands a request's body to the app's replica only after routing, so it could not route by the
prompt, and a proxy and an ingress replica would put two more hops between the engine and every
streamed token. The handle routes from here; Ray places, health-checks and restarts the
replicas. A cluster's nodes must each have flashformer (with its [cluster] extra) and the model
file at the same path.
"""

from __future__ import annotations

import time

import ray
import uvicorn
from ray import serve
from ray.serve.config import RequestRouterConfig

from flashformer.checkpoints.loading import load_tokenizer
from flashformer.serve.app import create_app
from flashformer.serve.cluster.remote import RemoteEngine, add_cluster_routes
from flashformer.serve.cluster.replica import EngineReplica
from flashformer.serve.cluster.router import PrefixAffinityRouter

APP = "flashformer"  # the Ray Serve application's name
DEPLOYMENT = "engine"
HEALTH_CHECK_S = 2.0  # how often Ray asks each replica; a dead one is replaced after a failed check


def deploy(
    model: str,
    *,
    replicas: int,
    threads: int,
    load_options: dict,
    engine_options: dict,
    ray_address: str | None = None,
) -> RemoteEngine:
    """Start (or join) Ray, run the deployment, and return the RemoteEngine the app serves
    (blocks until every replica has loaded the model)."""
    if replicas < 1:
        raise ValueError(f"--replicas must be at least 1; got {replicas}")
    if threads < 1:
        raise ValueError(f"--threads must be at least 1; got {threads}")
    tokenizer = load_tokenizer(model)  # a wrong path fails here, before Ray starts
    ray.init(address=ray_address, include_dashboard=False, configure_logging=False)
    cpus = ray.cluster_resources().get("CPU", 0)
    if ray_address is None and replicas * threads > cpus:  # Ray would wait for CPUs forever
        ray.shutdown()
        raise ValueError(
            f"--replicas {replicas} x --threads {threads} needs {replicas * threads} CPUs; this machine "
            f"has {cpus:g} (fewer replicas or threads, or a cluster: --ray-address)"
        )
    quiet = {"log_level": "WARNING", "enable_access_log": False}  # no line per request
    serve.start(proxy_location="Disabled", logging_config=quiet)
    max_batch = engine_options.get("max_batch", 16)
    max_waiting = engine_options.get("max_waiting", 256)
    deployment = serve.deployment(EngineReplica, name=DEPLOYMENT).options(
        num_replicas=replicas,
        ray_actor_options={"num_cpus": threads},
        # Ray's queue limit per replica: the engine's own (its batch and its waiting queue)
        max_ongoing_requests=max_batch + max_waiting,
        logging_config=quiet,
        health_check_period_s=HEALTH_CHECK_S,
        health_check_timeout_s=10 * HEALTH_CHECK_S,
        request_router_config=RequestRouterConfig(
            request_router_class=PrefixAffinityRouter,
            # affinity gives way when its replica has half a batch more requests than another
            request_router_kwargs={"imbalance": max(1, max_batch // 2)},
        ),
    )
    handle = serve.run(
        deployment.bind(model, load_options, engine_options, threads), name=APP, route_prefix=None
    )
    card = handle.describe.remote().result()
    return RemoteEngine(handle, tokenizer, card, replicas)


def replica_states() -> dict[str, int]:
    """Ray's count of the deployment's replicas by state ({"RUNNING": 2, "STARTING": 1})."""
    application = serve.status().applications.get(APP)
    if application is None or DEPLOYMENT not in application.deployments:
        return {}
    return {str(state): count for state, count in application.deployments[DEPLOYMENT].replica_states.items()}


def serve_replicas(
    model: str,
    *,
    name: str,
    host: str,
    port: int,
    replicas: int,
    threads: int,
    load_options: dict,
    engine_options: dict,
    ray_address: str | None = None,
    api_key: str | None = None,
    webui: bool = True,
    tool_parser: str | None = None,
) -> None:
    """Deploy, serve the app on host:port until Ctrl-C, then take the deployment down (and the
    local cluster, when this process started it)."""
    started = time.perf_counter()
    try:
        engine = deploy(
            model,
            replicas=replicas,
            threads=threads,
            load_options=load_options,
            engine_options=engine_options,
            ray_address=ray_address,
        )
        app = create_app(engine, name, api_key=api_key, webui=webui, tool_parser=tool_parser)
        add_cluster_routes(app, engine, replica_states)
        where = ray_address or "a local Ray cluster"
        print(
            f"serving {name} on http://{host}:{port}/v1 ({replicas} replicas x {threads} threads on "
            f"{where}, routed by prompt prefix; ready in {time.perf_counter() - started:.1f} s)",
            flush=True,
        )
        uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning")).run()
    finally:
        if ray.is_initialized():
            try:
                if ray_address is not None:  # a local cluster goes whole with ray.shutdown()
                    serve.delete(APP)
            finally:
                ray.shutdown()
