"""A cluster on paper: what a layout needs and how fast it runs, before anything is launched.

The step-time and memory models (``plan``, ``memory``, ``offload``, ``replay``), the machines they price
(``cluster``, ``gpus``, ``tensor_cores``, ``topology``), the models' shapes (``shapes``), serving's model
(``serve_plan``), and the published runs each is checked against (``published``, ``serve_published``,
``calibrate``). Nothing here starts a process or touches a GPU; a trainer may ask it whether a layout fits.
"""
