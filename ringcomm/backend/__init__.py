"""The torch.distributed backend "ringcomm": registration.py registers its name
once torch is loaded; process_group.py is the ProcessGroup; ops.py the bodies
of the collectives it accelerates; p2p.py its point-to-point calls; work.py its
Work objects and which calls it accelerates; forwarding.py the internal gloo
group of the calls it forwards; dynamo.py keeps torch.compile from tracing
ringcomm."""
