"""The cluster simulator's pieces (``python -m bench.cluster_sim`` drives them).

``agents.py``   one process of node and mount agents and membership views (real code)
``baseline.py`` the put and listing loops, the yardsticks
``moves.py``    placement moves on a join or leave, counted with ``placement.owners``
"""
