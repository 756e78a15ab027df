"""Where a batch runs: the interface every engine has (``interface``), the choice by
``model.engine`` (``choice``), the in-process thread (``local``) and a Ray Serve application
(``ray_serve``, with its driver in a child process: ``ray_bridge`` is the daemon's end,
``ray_bridge_child`` the child).
"""
