"""Every use of DeepSpeed's private API (deepspeed 0.19.8), each with the source it was checked against."""
