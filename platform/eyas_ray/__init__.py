"""Ray glue shared by the apps (jobs/, tune/, serving/): token auth, connecting to a cluster, a local head.

The library (``platform/eyas``) never imports Ray; the apps never import each other. What all three need from Ray
lives here, once.
"""
