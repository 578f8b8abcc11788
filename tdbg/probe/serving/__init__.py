"""The probe thread's side: the socket, resolving steps, alerts, recording."""
