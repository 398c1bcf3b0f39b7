"""Engine replicas on Ray Serve behind one endpoint, routed by prompt prefix (`flashformer serve
--replicas N`): affinity.py (the policy), router.py (Ray's request router), remote.py (what the
app is given in place of an Engine), replica.py (an Engine in a replica), launch.py (deploy and
serve). Ray (the [cluster] extra) is imported only by these modules, never by the package's
others, so a server without --replicas never loads it."""
