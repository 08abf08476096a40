"""The course's own tools around the trainers: the guided tour, the troubleshooter and its doctor, the lab server and
its kernels' sockets, the learner's progress file, predictions, bandwidth readings and SLURM jobs."""
