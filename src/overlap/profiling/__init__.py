"""What the tracer's events say: exposed communication per kind, Chrome traces and timeline pictures
of a run."""
