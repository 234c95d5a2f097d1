from mlx_server.cli import main

main()
